package main

// A reader for the part of YAML that Chart.yaml and values.yaml use: block mappings and sequences,
// plain, single- and double-quoted scalars, flow sequences and mappings on one line, and comments.
// Anything else (block scalars, anchors, tags, several documents) is an error that names the line,
// so the chart cannot silently drift out of what this renderer reads.

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

type yamlLine struct {
	number int // 1-based, for errors
	indent int
	text   string
}

type yamlReader struct {
	origin string
	lines  []yamlLine
	pos    int
}

func parseYAML(origin, source string) (interface{}, error) {
	r := &yamlReader{origin: origin}
	for i, raw := range strings.Split(source, "\n") {
		raw = strings.TrimRight(raw, " \r")
		content := strings.TrimLeft(raw, " ")
		if strings.HasPrefix(content, "\t") {
			return nil, r.errorAt(i+1, "tab in indentation")
		}
		content = strings.TrimRight(stripComment(content), " ")
		if content == "" {
			continue
		}
		if content == "---" && len(r.lines) == 0 {
			continue
		}
		r.lines = append(r.lines, yamlLine{number: i + 1, indent: len(raw) - len(strings.TrimLeft(raw, " ")), text: content})
	}
	if len(r.lines) == 0 {
		return map[string]interface{}{}, nil
	}
	value, err := r.block(r.lines[0].indent)
	if err != nil {
		return nil, err
	}
	if r.pos < len(r.lines) {
		return nil, r.errorAt(r.lines[r.pos].number, "unexpected indentation")
	}
	return value, nil
}

func (r *yamlReader) errorAt(line int, format string, args ...interface{}) error {
	return fmt.Errorf("%s:%d: %s", r.origin, line, fmt.Sprintf(format, args...))
}

// stripComment drops a `#` comment that starts the text or follows a space, outside quotes.
func stripComment(text string) string {
	var quote rune
	for i, c := range text {
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			}
		case c == '"' || c == '\'':
			quote = c
		case c == '#' && (i == 0 || text[i-1] == ' '):
			return text[:i]
		}
	}
	return text
}

func isSequenceItem(text string) bool {
	return text == "-" || strings.HasPrefix(text, "- ")
}

func (r *yamlReader) block(indent int) (interface{}, error) {
	if isSequenceItem(r.lines[r.pos].text) {
		return r.sequence(indent)
	}
	return r.mapping(indent)
}

func (r *yamlReader) sequence(indent int) (interface{}, error) {
	items := []interface{}{}
	for r.pos < len(r.lines) && r.lines[r.pos].indent == indent && isSequenceItem(r.lines[r.pos].text) {
		line := r.lines[r.pos]
		rest := strings.TrimLeft(strings.TrimPrefix(line.text, "-"), " ")
		if rest == "" {
			r.pos++
			if r.pos < len(r.lines) && r.lines[r.pos].indent > indent {
				item, err := r.block(r.lines[r.pos].indent)
				if err != nil {
					return nil, err
				}
				items = append(items, item)
			} else {
				items = append(items, nil)
			}
			continue
		}
		if _, _, ok := splitKey(rest); ok {
			// "- key: value": a mapping whose keys line up with the text after the dash.
			r.lines[r.pos] = yamlLine{number: line.number, indent: line.indent + len(line.text) - len(rest), text: rest}
			item, err := r.mapping(r.lines[r.pos].indent)
			if err != nil {
				return nil, err
			}
			items = append(items, item)
			continue
		}
		item, err := r.scalar(line.number, rest)
		if err != nil {
			return nil, err
		}
		items = append(items, item)
		r.pos++
	}
	return items, nil
}

func (r *yamlReader) mapping(indent int) (interface{}, error) {
	out := map[string]interface{}{}
	for r.pos < len(r.lines) && r.lines[r.pos].indent == indent {
		line := r.lines[r.pos]
		if isSequenceItem(line.text) {
			return nil, r.errorAt(line.number, "sequence item inside a mapping")
		}
		key, rest, ok := splitKey(line.text)
		if !ok {
			return nil, r.errorAt(line.number, "expected `key: value`, got %q", line.text)
		}
		if _, dup := out[key]; dup {
			return nil, r.errorAt(line.number, "duplicate key %q", key)
		}
		r.pos++
		if rest != "" {
			value, err := r.scalar(line.number, rest)
			if err != nil {
				return nil, err
			}
			out[key] = value
			continue
		}
		switch {
		case r.pos < len(r.lines) && r.lines[r.pos].indent > indent:
			value, err := r.block(r.lines[r.pos].indent)
			if err != nil {
				return nil, err
			}
			out[key] = value
		case r.pos < len(r.lines) && r.lines[r.pos].indent == indent && isSequenceItem(r.lines[r.pos].text):
			value, err := r.sequence(indent)
			if err != nil {
				return nil, err
			}
			out[key] = value
		default:
			out[key] = nil
		}
	}
	if r.pos < len(r.lines) && r.lines[r.pos].indent > indent {
		return nil, r.errorAt(r.lines[r.pos].number, "unexpected indentation")
	}
	return out, nil
}

// splitKey splits `key: value` (or `key:`) at the first colon that ends the key, outside quotes.
func splitKey(text string) (string, string, bool) {
	if strings.HasPrefix(text, "[") || strings.HasPrefix(text, "{") {
		return "", "", false
	}
	var quote rune
	for i, c := range text {
		switch {
		case quote != 0:
			if c == quote {
				quote = 0
			}
		case (c == '"' || c == '\'') && i == 0:
			quote = c
		case c == ':' && (i+1 == len(text) || text[i+1] == ' '):
			key := strings.TrimSpace(text[:i])
			if unquoted, ok := unquote(key); ok {
				key = unquoted
			}
			return key, strings.TrimSpace(text[i+1:]), key != ""
		}
	}
	return "", "", false
}

func unquote(text string) (string, bool) {
	if len(text) >= 2 && text[0] == '"' && text[len(text)-1] == '"' {
		s, err := strconv.Unquote(text)
		return s, err == nil
	}
	if len(text) >= 2 && text[0] == '\'' && text[len(text)-1] == '\'' {
		return strings.ReplaceAll(text[1:len(text)-1], "''", "'"), true
	}
	return "", false
}

var (
	intPattern   = regexp.MustCompile(`^[-+]?[0-9]+$`)
	floatPattern = regexp.MustCompile(`^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$`)
)

func (r *yamlReader) scalar(line int, text string) (interface{}, error) {
	switch text[0] {
	case '|', '>':
		return nil, r.errorAt(line, "block scalars are not supported")
	case '&', '*', '!':
		return nil, r.errorAt(line, "anchors, aliases and tags are not supported")
	case '[':
		return r.flow(line, text, '[', ']')
	case '{':
		return r.flow(line, text, '{', '}')
	case '"', '\'':
		s, ok := unquote(text)
		if !ok {
			return nil, r.errorAt(line, "bad quoted string %s", text)
		}
		return s, nil
	}
	switch text {
	case "null", "~", "Null", "NULL":
		return nil, nil
	case "true", "True", "TRUE":
		return true, nil
	case "false", "False", "FALSE":
		return false, nil
	}
	if intPattern.MatchString(text) {
		if n, err := strconv.ParseInt(text, 10, 64); err == nil {
			return n, nil
		}
	}
	if floatPattern.MatchString(text) {
		if f, err := strconv.ParseFloat(text, 64); err == nil {
			return f, nil
		}
	}
	return text, nil
}

// flow reads a one-line flow sequence or mapping of scalars.
func (r *yamlReader) flow(line int, text string, open, close byte) (interface{}, error) {
	if text[len(text)-1] != close {
		return nil, r.errorAt(line, "flow collection must close on its line: %s", text)
	}
	inner := strings.TrimSpace(text[1 : len(text)-1])
	var parts []string
	if inner != "" {
		var quote rune
		start := 0
		for i, c := range inner {
			switch {
			case quote != 0:
				if c == quote {
					quote = 0
				}
			case c == '"' || c == '\'':
				quote = c
			case c == '[' || c == '{':
				return nil, r.errorAt(line, "nested flow collections are not supported")
			case c == ',':
				parts = append(parts, strings.TrimSpace(inner[start:i]))
				start = i + 1
			}
		}
		parts = append(parts, strings.TrimSpace(inner[start:]))
	}
	if open == '[' {
		items := []interface{}{}
		for _, p := range parts {
			v, err := r.scalar(line, p)
			if err != nil {
				return nil, err
			}
			items = append(items, v)
		}
		return items, nil
	}
	out := map[string]interface{}{}
	for _, p := range parts {
		key, rest, ok := splitKey(p)
		if !ok || rest == "" {
			return nil, r.errorAt(line, "expected `key: value` in %s", text)
		}
		v, err := r.scalar(line, rest)
		if err != nil {
			return nil, err
		}
		out[key] = v
	}
	return out, nil
}
