//! Decodes the protobuf request bodies of the typed kubectl commands a person uses against the
//! sandbox (`kubectl create namespace`, `kubectl create configmap`) and of Helm's release records
//! (`HELM_DRIVER=configmap`: a ConfigMap, and the DeleteOptions of `helm uninstall`) into JSON.
//! Kubernetes wraps them in a `runtime.Unknown` envelope after the magic bytes `k8s\0`.

use serde_json::{json, Map, Value};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtobufError {
    #[error("the body does not start with the Kubernetes protobuf magic bytes")]
    NoMagic,
    #[error("malformed protobuf: {0}")]
    Malformed(&'static str),
    #[error("protobuf bodies of kind {0:?} are not supported by the emulator; send JSON (kubectl apply -f)")]
    UnsupportedKind(String),
}

enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    Fixed,
}

fn read_varint(input: &[u8], pos: &mut usize) -> Result<u64, ProtobufError> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *input
            .get(*pos)
            .ok_or(ProtobufError::Malformed("truncated varint"))?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(ProtobufError::Malformed("varint too long"))
}

fn fields(input: &[u8]) -> Result<Vec<(u64, Wire<'_>)>, ProtobufError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < input.len() {
        let key = read_varint(input, &mut pos)?;
        let wire = match key & 7 {
            0 => Wire::Varint(read_varint(input, &mut pos)?),
            1 => {
                pos += 8;
                Wire::Fixed
            }
            2 => {
                let len = read_varint(input, &mut pos)? as usize;
                let end = pos.checked_add(len).filter(|e| *e <= input.len());
                let end = end.ok_or(ProtobufError::Malformed("length past the end"))?;
                let bytes = &input[pos..end];
                pos = end;
                Wire::Bytes(bytes)
            }
            5 => {
                pos += 4;
                Wire::Fixed
            }
            _ => return Err(ProtobufError::Malformed("unsupported wire type")),
        };
        out.push((key >> 3, wire));
    }
    if pos > input.len() {
        return Err(ProtobufError::Malformed("fixed field past the end"));
    }
    Ok(out)
}

fn text(bytes: &[u8]) -> Value {
    Value::String(String::from_utf8_lossy(bytes).into_owned())
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Adds a `map<string, string|bytes>` entry to `map`.
fn add_map_entry(
    map: &mut Map<String, Value>,
    bytes: &[u8],
    binary: bool,
) -> Result<(), ProtobufError> {
    let (mut key, mut value) = (String::new(), Value::String(String::new()));
    for (number, wire) in fields(bytes)? {
        match (number, wire) {
            (1, Wire::Bytes(b)) => key = String::from_utf8_lossy(b).into_owned(),
            (2, Wire::Bytes(b)) if binary => value = Value::String(base64(b)),
            (2, Wire::Bytes(b)) => value = text(b),
            _ => {}
        }
    }
    map.insert(key, value);
    Ok(())
}

/// Sets `key` to a map or list unless it is empty, which JSON omits.
fn insert_unless_empty(object: &mut Map<String, Value>, key: &str, value: Value) {
    let empty = match &value {
        Value::Object(map) => map.is_empty(),
        Value::Array(items) => items.is_empty(),
        _ => false,
    };
    if !empty {
        object.insert(key.into(), value);
    }
}

fn object_meta(bytes: &[u8]) -> Result<Value, ProtobufError> {
    let mut meta = Map::new();
    let mut labels = Map::new();
    let mut annotations = Map::new();
    let mut finalizers = Vec::new();
    const STRINGS: [(u64, &str); 5] = [
        (1, "name"),
        (2, "generateName"),
        (3, "namespace"),
        (5, "uid"),
        (6, "resourceVersion"),
    ];
    for (number, wire) in fields(bytes)? {
        match (number, wire) {
            // Go writes unset optional strings as "", which JSON omits.
            (n, Wire::Bytes(b)) if STRINGS.iter().any(|(f, _)| *f == n) => {
                if let Some((_, name)) = STRINGS
                    .iter()
                    .find(|(f, _)| *f == n)
                    .filter(|_| !b.is_empty())
                {
                    meta.insert((*name).into(), text(b));
                }
            }
            (11, Wire::Bytes(b)) => add_map_entry(&mut labels, b, false)?,
            (12, Wire::Bytes(b)) => add_map_entry(&mut annotations, b, false)?,
            (14, Wire::Bytes(b)) => finalizers.push(text(b)),
            _ => {}
        }
    }
    insert_unless_empty(&mut meta, "labels", Value::Object(labels));
    insert_unless_empty(&mut meta, "annotations", Value::Object(annotations));
    insert_unless_empty(&mut meta, "finalizers", Value::Array(finalizers));
    Ok(Value::Object(meta))
}

fn namespace(bytes: &[u8]) -> Result<Value, ProtobufError> {
    let mut object = json!({"apiVersion": "v1", "kind": "Namespace"});
    for (number, wire) in fields(bytes)? {
        if let (1, Wire::Bytes(b)) = (number, wire) {
            object["metadata"] = object_meta(b)?;
        }
    }
    Ok(object)
}

fn config_map(bytes: &[u8]) -> Result<Value, ProtobufError> {
    let mut object = json!({"apiVersion": "v1", "kind": "ConfigMap"});
    let mut data = Map::new();
    let mut binary = Map::new();
    for (number, wire) in fields(bytes)? {
        match (number, wire) {
            (1, Wire::Bytes(b)) => object["metadata"] = object_meta(b)?,
            (2, Wire::Bytes(b)) => add_map_entry(&mut data, b, false)?,
            (3, Wire::Bytes(b)) => add_map_entry(&mut binary, b, true)?,
            (4, Wire::Varint(v)) => object["immutable"] = json!(v != 0),
            _ => {}
        }
    }
    let map = object.as_object_mut().expect("built as an object");
    insert_unless_empty(map, "data", Value::Object(data));
    insert_unless_empty(map, "binaryData", Value::Object(binary));
    Ok(object)
}

/// `meta.k8s.io/v1` DeleteOptions, which typed clients send with a DELETE.
fn delete_options(bytes: &[u8]) -> Result<Value, ProtobufError> {
    let mut object = json!({"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions"});
    let mut dry_run = Vec::new();
    for (number, wire) in fields(bytes)? {
        match (number, wire) {
            // int64: a negative value is the two's complement in ten bytes.
            (1, Wire::Varint(v)) => object["gracePeriodSeconds"] = json!(v as i64),
            (2, Wire::Bytes(b)) => {
                let mut preconditions = Map::new();
                for (n, w) in fields(b)? {
                    match (n, w) {
                        (1, Wire::Bytes(uid)) => preconditions.insert("uid".into(), text(uid)),
                        (2, Wire::Bytes(rv)) => {
                            preconditions.insert("resourceVersion".into(), text(rv))
                        }
                        _ => None,
                    };
                }
                object["preconditions"] = Value::Object(preconditions);
            }
            (3, Wire::Varint(v)) => object["orphanDependents"] = json!(v != 0),
            (4, Wire::Bytes(b)) => object["propagationPolicy"] = text(b),
            (5, Wire::Bytes(b)) => dry_run.push(text(b)),
            _ => {}
        }
    }
    let map = object.as_object_mut().expect("built as an object");
    insert_unless_empty(map, "dryRun", Value::Array(dry_run));
    Ok(object)
}

/// The JSON form of a `application/vnd.kubernetes.protobuf` body.
pub fn decode(body: &[u8]) -> Result<Value, ProtobufError> {
    let envelope = body.strip_prefix(b"k8s\0").ok_or(ProtobufError::NoMagic)?;
    let (mut kind, mut raw) = (String::new(), &[][..]);
    for (number, wire) in fields(envelope)? {
        match (number, wire) {
            (1, Wire::Bytes(type_meta)) => {
                for (n, w) in fields(type_meta)? {
                    if let (2, Wire::Bytes(k)) = (n, w) {
                        kind = String::from_utf8_lossy(k).into_owned();
                    }
                }
            }
            (2, Wire::Bytes(bytes)) => raw = bytes,
            _ => {}
        }
    }
    match kind.as_str() {
        "Namespace" => namespace(raw),
        "ConfigMap" => config_map(raw),
        "DeleteOptions" => delete_options(raw),
        _ => Err(ProtobufError::UnsupportedKind(kind)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(number: u64, bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![((number << 3) | 2) as u8, bytes.len() as u8];
        out.extend_from_slice(bytes);
        out
    }

    fn envelope(kind: &str, raw: &[u8]) -> Vec<u8> {
        let type_meta = [field(1, b"v1"), field(2, kind.as_bytes())].concat();
        [b"k8s\0".to_vec(), field(1, &type_meta), field(2, raw)].concat()
    }

    #[test]
    fn decodes_a_namespace() {
        let meta = [
            field(1, b"team-a"),
            field(11, &[field(1, b"env"), field(2, b"dev")].concat()),
        ]
        .concat();
        let body = envelope("Namespace", &field(1, &meta));
        assert_eq!(
            decode(&body).unwrap(),
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a", "labels": {"env": "dev"}}})
        );
    }

    #[test]
    fn decodes_a_config_map() {
        let raw = [
            field(1, &field(1, b"cfg")),
            field(2, &[field(1, b"a"), field(2, b"1")].concat()),
            field(3, &[field(1, b"bin"), field(2, b"hi!")].concat()),
            vec![(4 << 3) as u8, 1],
        ]
        .concat();
        assert_eq!(
            decode(&envelope("ConfigMap", &raw)).unwrap(),
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"a": "1"},
                "binaryData": {"bin": "aGkh"}, "immutable": true})
        );
    }

    #[test]
    fn decodes_delete_options() {
        let raw = [
            vec![1 << 3, 0],
            field(2, &[field(1, b"u-1"), field(2, b"42")].concat()),
            field(4, b"Orphan"),
            field(5, b"All"),
        ]
        .concat();
        assert_eq!(
            decode(&envelope("DeleteOptions", &raw)).unwrap(),
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": "u-1", "resourceVersion": "42"},
                "propagationPolicy": "Orphan", "dryRun": ["All"]})
        );
    }

    #[test]
    fn other_kinds_and_garbage_are_errors() {
        assert_eq!(
            decode(&envelope("Pod", &[])).unwrap_err(),
            ProtobufError::UnsupportedKind("Pod".into())
        );
        assert_eq!(decode(b"{}").unwrap_err(), ProtobufError::NoMagic);
        assert!(decode(b"k8s\0\x0a\x7f").is_err());
    }
}
