// helm-render renders a Helm chart the way `helm template` does, for the part of Helm's template
// language that deploy/helm/gpupool uses. No real helm can be installed where gpupool is built and
// tested (it is not packaged for Debian and needs modules from outside), so this stdlib-only program
// lets e2e/tests/deploy_manifests.rs compare the chart's objects with the kustomize base.
//
// Usage:
//
//	go run ./deploy/tools/helm-render -chart deploy/helm/gpupool -namespace gpupool \
//	    [-name gpupool] [-include-crds] [-f extra-values.yaml] [-set key.path=value]...
//
// Supported: text/template itself (define, template, if, with, range, and the built-in functions),
// .Values (values.yaml, then -f files, then -set), .Release.{Name,Namespace,Service,IsInstall},
// .Chart.<Field> from Chart.yaml, and the functions include, default, empty, quote, squote,
// toYaml and toJson (both emit JSON, which is valid YAML), indent, nindent, required, trim,
// trimSuffix, lower, upper, list. Anything else fails the render with Go's "function not defined".
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"text/template"
)

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

func main() {
	var (
		chartDir    = flag.String("chart", "", "chart folder (holds Chart.yaml)")
		releaseName = flag.String("name", "gpupool", "release name")
		namespace   = flag.String("namespace", "default", "release namespace")
		includeCRDs = flag.Bool("include-crds", false, "also print the chart's crds/ files, first")
		valueFiles  stringList
		sets        stringList
	)
	flag.Var(&valueFiles, "f", "values file merged over values.yaml (repeatable)")
	flag.Var(&sets, "set", "key.path=value merged over the values (repeatable)")
	flag.Parse()
	if *chartDir == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: helm-render -chart DIR [-name NAME] [-namespace NS] [-include-crds] [-f FILE]... [-set k=v]...")
		os.Exit(2)
	}
	if err := render(os.Stdout, *chartDir, *releaseName, *namespace, *includeCRDs, valueFiles, sets); err != nil {
		fmt.Fprintln(os.Stderr, "helm-render:", err)
		os.Exit(1)
	}
}

func render(out io.Writer, chartDir, releaseName, namespace string, includeCRDs bool, valueFiles, sets []string) error {
	chartMeta, err := readYAMLMap(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		return err
	}
	chartName, _ := chartMeta["name"].(string)
	if chartName == "" {
		return errors.New("Chart.yaml: name is missing")
	}
	values, err := readYAMLMap(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		return err
	}
	for _, file := range valueFiles {
		extra, err := readYAMLMap(file)
		if err != nil {
			return err
		}
		values = merge(values, extra)
	}
	for _, set := range sets {
		if err := applySet(values, set); err != nil {
			return err
		}
	}

	chart := map[string]interface{}{}
	for k, v := range chartMeta {
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}
	data := map[string]interface{}{
		"Values": values,
		"Chart":  chart,
		"Release": map[string]interface{}{
			"Name": releaseName, "Namespace": namespace, "Service": "Helm", "IsInstall": true, "IsUpgrade": false,
		},
	}

	if includeCRDs {
		crds, _ := filepath.Glob(filepath.Join(chartDir, "crds", "*.yaml"))
		sort.Strings(crds)
		for _, path := range crds {
			text, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			writeDocuments(out, chartName+"/crds/"+filepath.Base(path), string(text))
		}
	}

	root := template.New(chartName).Option("missingkey=zero")
	root.Funcs(functions(root))
	files, err := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	if err != nil {
		return err
	}
	sort.Strings(files)
	var manifests []string
	for _, path := range files {
		base := filepath.Base(path)
		if !strings.HasSuffix(base, ".yaml") && !strings.HasSuffix(base, ".yml") && !strings.HasSuffix(base, ".tpl") {
			continue
		}
		text, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		name := chartName + "/templates/" + base
		if _, err := root.New(name).Parse(string(text)); err != nil {
			return err
		}
		if !strings.HasPrefix(base, "_") && !strings.HasSuffix(base, ".tpl") {
			manifests = append(manifests, name)
		}
	}
	for _, name := range manifests {
		var buf bytes.Buffer
		if err := root.ExecuteTemplate(&buf, name, data); err != nil {
			return err
		}
		// Helm prints missing values as nothing, not as text/template's "<no value>".
		writeDocuments(out, name, strings.ReplaceAll(buf.String(), "<no value>", ""))
	}
	return nil
}

// writeDocuments prints each YAML document of text that holds more than comments, under a
// `# Source:` line as helm template does.
func writeDocuments(out io.Writer, source, text string) {
	var docs [][]string
	current := []string{}
	for _, line := range strings.Split(text, "\n") {
		if strings.TrimRight(line, " ") == "---" {
			docs = append(docs, current)
			current = []string{}
			continue
		}
		current = append(current, line)
	}
	docs = append(docs, current)
	for _, doc := range docs {
		substantial := false
		for _, line := range doc {
			trimmed := strings.TrimSpace(line)
			if trimmed != "" && !strings.HasPrefix(trimmed, "#") {
				substantial = true
				break
			}
		}
		if substantial {
			fmt.Fprintf(out, "---\n# Source: %s\n%s\n", source, strings.Trim(strings.Join(doc, "\n"), "\n"))
		}
	}
}

func readYAMLMap(path string) (map[string]interface{}, error) {
	text, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	value, err := parseYAML(path, string(text))
	if err != nil {
		return nil, err
	}
	m, ok := value.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("%s: top level is not a mapping", path)
	}
	return m, nil
}

// merge lays over onto base, recursively for mappings; a null in over removes the key (as helm does).
func merge(base, over map[string]interface{}) map[string]interface{} {
	for k, v := range over {
		if v == nil {
			delete(base, k)
			continue
		}
		if vm, ok := v.(map[string]interface{}); ok {
			if bm, ok := base[k].(map[string]interface{}); ok {
				base[k] = merge(bm, vm)
				continue
			}
		}
		base[k] = v
	}
	return base
}

// applySet applies one `a.b.c=value` the way helm --set types it: true/false, integers, null, else a string.
func applySet(values map[string]interface{}, set string) error {
	eq := strings.Index(set, "=")
	if eq <= 0 {
		return fmt.Errorf("-set %q: expected key.path=value", set)
	}
	path, raw := set[:eq], set[eq+1:]
	if strings.ContainsAny(path, "[]") {
		return fmt.Errorf("-set %q: list indexes are not supported", set)
	}
	var value interface{} = raw
	switch {
	case raw == "true":
		value = true
	case raw == "false":
		value = false
	case raw == "null":
		value = nil
	default:
		if n, err := strconv.ParseInt(raw, 10, 64); err == nil {
			value = n
		}
	}
	keys := strings.Split(path, ".")
	node := values
	for _, k := range keys[:len(keys)-1] {
		next, ok := node[k].(map[string]interface{})
		if !ok {
			next = map[string]interface{}{}
			node[k] = next
		}
		node = next
	}
	last := keys[len(keys)-1]
	if value == nil {
		delete(node, last)
	} else {
		node[last] = value
	}
	return nil
}

func empty(v interface{}) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.String, reflect.Map, reflect.Slice, reflect.Array:
		return rv.Len() == 0
	case reflect.Bool:
		return !rv.Bool()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return rv.Int() == 0
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return rv.Uint() == 0
	case reflect.Float32, reflect.Float64:
		return rv.Float() == 0
	case reflect.Ptr, reflect.Interface:
		return rv.IsNil()
	}
	return false
}

func toString(v interface{}) string {
	switch s := v.(type) {
	case nil:
		return ""
	case string:
		return s
	case []byte:
		return string(s)
	case error:
		return s.Error()
	case fmt.Stringer:
		return s.String()
	}
	return fmt.Sprint(v)
}

func toJSON(v interface{}) string {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return ""
	}
	return strings.TrimSuffix(buf.String(), "\n")
}

func indent(n int, s string) string {
	pad := strings.Repeat(" ", n)
	return pad + strings.ReplaceAll(s, "\n", "\n"+pad)
}

func functions(root *template.Template) template.FuncMap {
	return template.FuncMap{
		"include": func(name string, data interface{}) (string, error) {
			var buf bytes.Buffer
			if err := root.ExecuteTemplate(&buf, name, data); err != nil {
				return "", err
			}
			return buf.String(), nil
		},
		"default": func(fallback interface{}, given ...interface{}) interface{} {
			if len(given) == 0 || empty(given[0]) {
				return fallback
			}
			return given[0]
		},
		"empty": empty,
		"quote": func(args ...interface{}) string {
			var out []string
			for _, a := range args {
				if a != nil {
					out = append(out, strconv.Quote(toString(a)))
				}
			}
			return strings.Join(out, " ")
		},
		"squote": func(args ...interface{}) string {
			var out []string
			for _, a := range args {
				if a != nil {
					out = append(out, "'"+toString(a)+"'")
				}
			}
			return strings.Join(out, " ")
		},
		"toYaml":  toJSON,
		"toJson":  toJSON,
		"indent":  indent,
		"nindent": func(n int, s string) string { return "\n" + indent(n, s) },
		"required": func(message string, v interface{}) (interface{}, error) {
			if v == nil || v == "" {
				return nil, errors.New(message)
			}
			return v, nil
		},
		"trim":       strings.TrimSpace,
		"trimSuffix": func(suffix, s string) string { return strings.TrimSuffix(s, suffix) },
		"lower":      strings.ToLower,
		"upper":      strings.ToUpper,
		"list":       func(items ...interface{}) []interface{} { return items },
	}
}
