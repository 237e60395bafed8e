package main

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestParseYAMLReadsTheValuesSubset(t *testing.T) {
	source := `
# comment
image:
  repository: gpupool   # trailing comment
  tag: ""
  pullPolicy: 'IfNotPresent'
replicas: 2
ratio: 0.5
enabled: true
nothing: null
url: http://example.invalid/a#b
tolerations:
  - key: nvidia.com/gpu
    operator: Exists
  - key: "gpupool.dev/gpu"
list:
- a
- "true"
flow: ["get", list, 3]
empty: {}
none: []
nested:
  deeper:
    values:
      - "true"
`
	got, err := parseYAML("values.yaml", source)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]interface{}{
		"image":    map[string]interface{}{"repository": "gpupool", "tag": "", "pullPolicy": "IfNotPresent"},
		"replicas": int64(2),
		"ratio":    0.5,
		"enabled":  true,
		"nothing":  nil,
		"url":      "http://example.invalid/a#b",
		"tolerations": []interface{}{
			map[string]interface{}{"key": "nvidia.com/gpu", "operator": "Exists"},
			map[string]interface{}{"key": "gpupool.dev/gpu"},
		},
		"list":   []interface{}{"a", "true"},
		"flow":   []interface{}{"get", "list", int64(3)},
		"empty":  map[string]interface{}{},
		"none":   []interface{}{},
		"nested": map[string]interface{}{"deeper": map[string]interface{}{"values": []interface{}{"true"}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got  %#v\nwant %#v", got, want)
	}
}

func TestParseYAMLRefusesWhatItDoesNotRead(t *testing.T) {
	for _, source := range []string{
		"a: |\n  text\n",
		"a: &anchor 1\n",
		"a: 1\n a: 2\n",
		"a: 1\na: 2\n",
		"a:\n\t- 1\n",
		"a: [1, [2]]\n",
	} {
		if _, err := parseYAML("bad.yaml", source); err == nil {
			t.Errorf("accepted %q", source)
		} else if !strings.HasPrefix(err.Error(), "bad.yaml:") {
			t.Errorf("error %q does not name the file and line", err)
		}
	}
}

func TestApplySetTypesValuesLikeHelm(t *testing.T) {
	values := map[string]interface{}{"driver": map[string]interface{}{"healthzPort": int64(1), "keep": "x"}}
	for _, set := range []string{"driver.healthzPort=51515", "fakeGpus=a100-40gb:2", "driver.enabled=false", "driver.keep=null"} {
		if err := applySet(values, set); err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]interface{}{
		"driver":   map[string]interface{}{"healthzPort": int64(51515), "enabled": false},
		"fakeGpus": "a100-40gb:2",
	}
	if !reflect.DeepEqual(values, want) {
		t.Fatalf("got %#v", values)
	}
	if err := applySet(values, "list[0]=a"); err == nil {
		t.Fatal("list indexes accepted")
	}
}

func TestTemplateFunctionsBehaveLikeHelms(t *testing.T) {
	chart := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		if err := writeFile(chart, name, text); err != nil {
			t.Fatal(err)
		}
	}
	write("Chart.yaml", "apiVersion: v2\nname: demo\nversion: 1.0.0\nappVersion: 2.0.0\n")
	write("values.yaml", "tag: \"\"\nresources:\n  limits:\n    memory: 1Gi\nname: a \"b\"\n")
	write("templates/_helpers.tpl", `{{- define "demo.labels" -}}app: {{ . }}{{- end }}`)
	write("templates/a.yaml", `# only a comment
---
kind: A
metadata:
  name: {{ .Release.Name }}-{{ .Chart.Name }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "demo.labels" "x" | nindent 4 }}
image: {{ .Values.tag | default .Chart.AppVersion | quote }}
title: {{ .Values.name | quote }}
missing: "{{ .Values.nothing }}"
resources:
  {{- toYaml .Values.resources | nindent 2 }}
`)
	var out strings.Builder
	if err := render(&out, chart, "rel", "ns", false, nil, nil); err != nil {
		t.Fatal(err)
	}
	want := `---
# Source: demo/templates/a.yaml
kind: A
metadata:
  name: rel-demo
  namespace: ns
  labels:
    app: x
image: "2.0.0"
title: "a \"b\""
missing: ""
resources:
  {"limits":{"memory":"1Gi"}}
`
	if out.String() != want {
		t.Fatalf("got:\n%s\nwant:\n%s", out.String(), want)
	}
}

// writeFile writes dir/name, creating its folder.
func writeFile(dir, name, text string) error {
	path := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(text), 0o644)
}
