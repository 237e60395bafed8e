//! The HTTP face of the emulator: URL routing like kube-apiserver, content negotiation (JSON, Table,
//! aggregated discovery), and watch streams of newline-delimited JSON events.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::auth::{self, Attributes, Tokens, UserInfo};
use crate::discovery;
use crate::latency::{self, Latency};
use crate::openapi;
use crate::protobuf;
use crate::resources::ResourceDef;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use crate::store::{
    DeleteOptions, EventType, FieldValidation, PatchType, Preconditions, Propagation, Requester,
    Store, StoredEvent, WriteOptions,
};
use crate::table;
use crate::watchcache::{CachedObject, WatchCache};

/// One request as the emulator received it; tests count writes with these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    /// Path and query, as sent.
    pub path: String,
    pub user_agent: String,
}

pub struct Shared {
    pub store: Mutex<Store>,
    pub changes: tokio::sync::watch::Sender<u64>,
    pub requests: Mutex<Vec<RequestRecord>>,
    pub server_address: String,
    /// Milliseconds between BOOKMARK events on watches that allow them.
    pub bookmark_interval_ms: std::sync::atomic::AtomicU64,
    pub latency: Latency,
    /// Locked after `store` where both are held.
    pub watch_cache: Option<Mutex<WatchCache>>,
    /// The bearer tokens this server accepts (see [`auth`]).
    pub tokens: Tokens,
}

impl Shared {
    /// With a latency profile, and a watch cache lagging `cache_lag` behind writes (none for zero).
    pub fn with_latency(server_address: String, latency: Latency, cache_lag: Duration) -> Self {
        let store = Store::new();
        let watch_cache =
            (!cache_lag.is_zero()).then(|| Mutex::new(WatchCache::new(cache_lag, &store)));
        Shared {
            store: Mutex::new(store),
            changes: tokio::sync::watch::channel(0).0,
            requests: Mutex::new(Vec::new()),
            server_address,
            bookmark_interval_ms: std::sync::atomic::AtomicU64::new(10_000),
            latency,
            watch_cache,
            tokens: Tokens::default(),
        }
    }

    fn bookmark_interval(&self) -> Duration {
        Duration::from_millis(
            self.bookmark_interval_ms
                .load(std::sync::atomic::Ordering::Relaxed)
                .max(1),
        )
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn notify(&self, store: &Store) {
        if let Some(cache) = &self.watch_cache {
            cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .observe(store, std::time::Instant::now());
        }
        self.changes.send_replace(store.current_rv());
    }

    /// Waits until the watch cache holds every write up to `rv` (a GET with that
    /// resourceVersion: "not older than"); the real server gives up after 3 s with a 504 when
    /// the version is still ahead of the store.
    async fn wait_for_cache(&self, rv: &str) -> Result<(), ApiError> {
        let wanted: u64 = rv
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid resource version {rv:?}")))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        loop {
            let now = std::time::Instant::now();
            let (current, ready) = {
                let store = self.store();
                let ready = self.watch_cache.as_ref().and_then(|cache| {
                    cache
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .caught_up_at(wanted, now)
                });
                (store.current_rv(), ready)
            };
            if current < wanted {
                if now >= deadline {
                    return Err(ApiError::too_large_resource_version(wanted, current));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            if let Some(at) = ready {
                latency::sleep_until_precisely(at).await;
            }
            return Ok(());
        }
    }

    /// A GET of one object with `resourceVersion=0`: from the watch cache, which may lag.
    fn cached_get(
        &self,
        def: &ResourceDef,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let store = self.store();
        let Some(cache) = &self.watch_cache else {
            return store.get(def, namespace, name);
        };
        let cached = cache.lock().unwrap_or_else(|p| p.into_inner()).get(
            def,
            namespace,
            name,
            std::time::Instant::now(),
        );
        match cached {
            CachedObject::Current => store.get(def, namespace, name),
            CachedObject::Stale(Some(object)) => Ok(Store::present(def, &object)),
            CachedObject::Stale(None) => Err(ApiError::not_found(def, name)),
        }
    }
}

fn percent_decode(input: &str) -> String {
    let bytes = input.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(hi), Some(lo)) => {
                    out.push(hi * 16 + lo);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn parse_query(query: Option<&str>) -> BTreeMap<String, String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(pair), String::new()),
        })
        .collect()
}

fn json_response(code: u16, value: &Value) -> Response {
    let mut response = (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        serde_json::to_vec(value).unwrap_or_default(),
    )
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(error: &ApiError) -> Response {
    json_response(error.code, &error.to_status())
}

fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for warning in warnings {
        let text = format!("299 - {:?}", warning);
        if let Ok(value) = HeaderValue::from_str(&text) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    response
}

struct RequestContext {
    user: UserInfo,
    method: Method,
    query: BTreeMap<String, String>,
    accept: String,
    content_type: String,
    body: Bytes,
}

impl RequestContext {
    fn param(&self, key: &str) -> Option<&str> {
        self.query.get(key).map(String::as_str)
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.param(key), Some("true") | Some("1"))
    }

    /// kube-rs' `*_metadata` calls ask for `PartialObjectMetadata`.
    fn wants_metadata(&self) -> bool {
        self.accept
            .split(',')
            .any(|m| m.contains("as=PartialObjectMetadata"))
    }

    fn wants_table(&self) -> bool {
        self.accept.split(',').any(|m| m.contains("as=Table"))
    }

    fn write_options(&self) -> Result<WriteOptions, ApiError> {
        Ok(WriteOptions {
            field_validation: FieldValidation::parse(self.param("fieldValidation"))?,
            dry_run: self.param("dryRun") == Some("All"),
            requester: Some(Requester {
                user: self.user.clone(),
                verb: auth::verb(self.method.as_str(), true, false),
            }),
        })
    }

    /// The `DeleteOptions` of a DELETE, from its body and its query (the real server reads both).
    fn delete_options(&self) -> Result<DeleteOptions, ApiError> {
        let options: Value = if self.body.is_empty() {
            json!({})
        } else {
            self.json_body()?
        };
        let text = |field: &str| {
            options
                .get(field)
                .and_then(Value::as_str)
                .map(String::from)
                .or_else(|| self.param(field).map(String::from))
        };
        let orphan_dependents = match options.get("orphanDependents").and_then(Value::as_bool) {
            Some(orphan) => Some(orphan),
            None => match self.param("orphanDependents") {
                None => None,
                Some(value) => Some(value.parse::<bool>().map_err(|_| {
                    ApiError::bad_request(format!("invalid orphanDependents: {value:?}"))
                })?),
            },
        };
        let propagation =
            Propagation::from_options(text("propagationPolicy").as_deref(), orphan_dependents)?;
        Ok(DeleteOptions {
            preconditions: Preconditions {
                uid: options
                    .pointer("/preconditions/uid")
                    .and_then(Value::as_str)
                    .map(String::from),
                resource_version: options
                    .pointer("/preconditions/resourceVersion")
                    .and_then(Value::as_str)
                    .map(String::from),
            },
            dry_run: self.param("dryRun") == Some("All")
                || options
                    .get("dryRun")
                    .and_then(Value::as_array)
                    .is_some_and(|d| d.iter().any(|v| v == "All")),
            propagation,
        })
    }

    fn selectors(&self) -> Result<(LabelSelector, FieldSelector), ApiError> {
        let labels = LabelSelector::parse(self.param("labelSelector").unwrap_or_default())
            .map_err(|e| ApiError::bad_request(format!("unable to parse labelSelector: {e}")))?;
        let fields = FieldSelector::parse(self.param("fieldSelector").unwrap_or_default())
            .map_err(|e| ApiError::bad_request(format!("unable to parse fieldSelector: {e}")))?;
        Ok((labels, fields))
    }

    fn json_body(&self) -> Result<Value, ApiError> {
        if self.content_type.contains("protobuf") {
            return protobuf::decode(&self.body).map_err(|e| {
                ApiError::unsupported_body_encoding(&format!("{} ({e})", self.content_type))
            });
        }
        if self.content_type.contains("cbor") {
            return Err(ApiError::unsupported_body_encoding(&self.content_type));
        }
        if self.content_type.contains("yaml") {
            return serde_yaml::from_slice(&self.body)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")));
        }
        serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("error decoding JSON: {e}")))
    }
}

pub async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header_str = |name: header::HeaderName| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let path_and_query = uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    shared
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(RequestRecord {
            method: method.to_string(),
            path: path_and_query,
            user_agent: header_str(header::USER_AGENT),
        });
    tracing::debug!(%method, %uri, "request");
    let user = match shared.tokens.authenticate(
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    ) {
        Ok(user) => user,
        Err(error) => return error_response(&error),
    };
    let ctx = RequestContext {
        user,
        method,
        query: parse_query(uri.query()),
        accept: header_str(header::ACCEPT),
        content_type: header_str(header::CONTENT_TYPE),
        body,
    };
    let segments: Vec<String> = uri
        .path()
        .split('/')
        .filter(|s| !s.is_empty())
        .map(percent_decode)
        .collect();
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    let cost = latency::classify(ctx.method.as_str(), &segments, &ctx.query);
    shared.latency.charge(cost).await;
    let non_resource = !matches!(
        segments.as_slice(),
        ["api", "v1", _, ..] | ["apis", _, _, _, ..]
    );
    if non_resource {
        let attrs = Attributes::NonResource {
            verb: &ctx.method.as_str().to_ascii_lowercase(),
            path: uri.path(),
        };
        if !auth::authorize(&shared.store(), &ctx.user, &attrs) {
            return error_response(&auth::forbidden(&ctx.user, &attrs));
        }
    }
    let resource_version = ctx.param("resourceVersion").unwrap_or_default();
    if ctx.method == Method::GET && !ctx.flag("watch") && !matches!(resource_version, "" | "0") {
        if let Err(error) = shared.wait_for_cache(resource_version).await {
            return error_response(&error);
        }
    }
    match route(&shared, &ctx, &segments) {
        Ok(response) => response,
        Err(error) => error_response(&error),
    }
}

fn discovery_response(value: Value, aggregated: Option<&str>) -> Response {
    let mut response = json_response(200, &value);
    if let Some(version) = aggregated {
        let content_type =
            format!("application/json;g=apidiscovery.k8s.io;v={version};as=APIGroupDiscoveryList");
        if let Ok(value) = HeaderValue::from_str(&content_type) {
            response.headers_mut().insert(header::CONTENT_TYPE, value);
        }
    }
    response
}

fn route(
    shared: &Arc<Shared>,
    ctx: &RequestContext,
    segments: &[&str],
) -> Result<Response, ApiError> {
    let get_only = || {
        if ctx.method == Method::GET {
            Ok(())
        } else {
            Err(ApiError::method_not_allowed(format!(
                "the server does not allow this method ({}) on the requested resource",
                ctx.method
            )))
        }
    };
    match segments {
        [] => {
            get_only()?;
            Ok(json_response(
                200,
                &json!({"paths": ["/api", "/api/v1", "/apis", "/openapi/v2", "/openapi/v3", "/version", "/healthz"]}),
            ))
        }
        ["version"] => {
            get_only()?;
            Ok(json_response(200, &discovery::version()))
        }
        ["healthz"] | ["readyz"] | ["livez"] => Ok((StatusCode::OK, "ok").into_response()),
        ["openapi", rest @ ..] => {
            get_only()?;
            let defs = shared.store().all_defs();
            openapi::serve(&defs, rest)
                .map(|doc| json_response(200, &doc))
                .ok_or_else(|| ApiError::not_found_path(&format!("/openapi/{}", rest.join("/"))))
        }
        ["api"] => {
            get_only()?;
            match discovery::wants_aggregated(&ctx.accept) {
                Some(version) => {
                    let defs = shared.store().all_defs();
                    Ok(discovery_response(
                        discovery::aggregated(&defs, true, version),
                        Some(version),
                    ))
                }
                None => Ok(json_response(
                    200,
                    &discovery::core_versions(&shared.server_address),
                )),
            }
        }
        ["apis"] => {
            get_only()?;
            let defs = shared.store().all_defs();
            match discovery::wants_aggregated(&ctx.accept) {
                Some(version) => Ok(discovery_response(
                    discovery::aggregated(&defs, false, version),
                    Some(version),
                )),
                None => Ok(json_response(200, &discovery::group_list(&defs))),
            }
        }
        ["api", "v1"] => {
            get_only()?;
            let defs = shared.store().all_defs();
            Ok(json_response(
                200,
                &discovery::resource_list(&defs, "", "v1").expect("core group"),
            ))
        }
        ["apis", group] => {
            get_only()?;
            let defs = shared.store().all_defs();
            discovery::group(&defs, group)
                .map(|g| json_response(200, &g))
                .ok_or_else(|| ApiError::not_found_path(&format!("/apis/{group}")))
        }
        ["apis", group, version] => {
            get_only()?;
            let defs = shared.store().all_defs();
            discovery::resource_list(&defs, group, version)
                .map(|l| json_response(200, &l))
                .ok_or_else(|| ApiError::not_found_path(&format!("/apis/{group}/{version}")))
        }
        ["api", "v1", rest @ ..] => resource_request(shared, ctx, "", "v1", rest),
        ["apis", group, version, rest @ ..] => resource_request(shared, ctx, group, version, rest),
        _ => Err(ApiError::not_found_path(&format!(
            "/{}",
            segments.join("/")
        ))),
    }
}

struct Target<'a> {
    def: ResourceDef,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    subresource: Option<&'a str>,
}

fn resolve<'a>(
    store: &Store,
    group: &str,
    version: &str,
    rest: &[&'a str],
) -> Result<Target<'a>, ApiError> {
    let not_found = || ApiError::not_found_path(&rest.join("/"));
    if rest.len() >= 3 && rest[0] == "namespaces" {
        if let Some(def) = store.find(group, version, rest[2]).filter(|d| d.namespaced) {
            if rest.len() > 5 {
                return Err(not_found());
            }
            return Ok(Target {
                def,
                namespace: Some(rest[1]),
                name: rest.get(3).copied(),
                subresource: rest.get(4).copied(),
            });
        }
    }
    let def = store.find(group, version, rest[0]).ok_or_else(not_found)?;
    if rest.len() > 3 || (def.namespaced && rest.len() > 1) {
        return Err(not_found());
    }
    Ok(Target {
        def,
        namespace: None,
        name: rest.get(1).copied(),
        subresource: rest.get(2).copied(),
    })
}

fn list_kind(def: &ResourceDef) -> String {
    format!("{}List", def.kind)
}

fn resource_request(
    shared: &Arc<Shared>,
    ctx: &RequestContext,
    group: &str,
    version: &str,
    rest: &[&str],
) -> Result<Response, ApiError> {
    let target = resolve(&shared.store(), group, version, rest)?;
    let def = &target.def;
    let ns = target.namespace;
    let verb = auth::verb(
        ctx.method.as_str(),
        target.name.is_some(),
        ctx.flag("watch"),
    );
    let attrs = auth::resource_attributes(def, verb, ns, target.name, target.subresource);
    if !auth::authorize(&shared.store(), &ctx.user, &attrs) {
        return Err(auth::forbidden(&ctx.user, &attrs));
    }
    let include = ctx.param("includeObject").unwrap_or_default().to_string();
    match (target.name, target.subresource, ctx.method.clone()) {
        (None, None, Method::GET) => {
            let (labels, fields) = ctx.selectors()?;
            if ctx.flag("watch") {
                return start_watch(
                    shared,
                    ctx,
                    def.clone(),
                    ns.map(String::from),
                    labels,
                    fields,
                );
            }
            let store = shared.store();
            let items = store.list(def, ns, &labels, &fields);
            let rv = store.current_rv().to_string();
            drop(store);
            if ctx.wants_table() {
                return Ok(json_response(
                    200,
                    &table::table(def, &items, &rv, &include),
                ));
            }
            if ctx.wants_metadata() {
                let items: Vec<Value> = items.iter().map(partial_metadata).collect();
                return Ok(json_response(
                    200,
                    &json!({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1",
                        "metadata": {"resourceVersion": rv}, "items": items}),
                ));
            }
            Ok(json_response(
                200,
                &json!({"kind": list_kind(def), "apiVersion": def.api_version(), "metadata": {"resourceVersion": rv}, "items": items}),
            ))
        }
        (None, None, Method::POST) => {
            let body = ctx.json_body()?;
            let mut store = shared.store();
            let outcome = store.create(def, ns, body, ctx.write_options()?)?;
            shared.notify(&store);
            Ok(with_warnings(
                json_response(201, &outcome.object),
                &outcome.warnings,
            ))
        }
        (None, None, Method::DELETE) => {
            let (labels, fields) = ctx.selectors()?;
            let options = ctx.delete_options()?;
            let mut store = shared.store();
            let deleted = store.delete_collection(def, ns, &labels, &fields, &options)?;
            shared.notify(&store);
            let rv = store.current_rv().to_string();
            Ok(json_response(
                200,
                &json!({"kind": list_kind(def), "apiVersion": def.api_version(), "metadata": {"resourceVersion": rv}, "items": deleted}),
            ))
        }
        (Some(name), None | Some("status"), Method::GET) => {
            let object = match ctx.param("resourceVersion") {
                None | Some("") => shared.store().get(def, ns, name)?,
                Some("0") => shared.cached_get(def, ns, name)?,
                // `handle` waited until the cache caught up with that version.
                Some(_) => shared.cached_get(def, ns, name)?,
            };
            if ctx.wants_table() {
                let rv = object
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                return Ok(json_response(
                    200,
                    &table::table(def, &[object], &rv, &include),
                ));
            }
            if ctx.wants_metadata() {
                return Ok(json_response(200, &partial_metadata(&object)));
            }
            Ok(json_response(200, &object))
        }
        (Some(name), sub @ (None | Some("status")), Method::PUT) => {
            if sub.is_some() && !def.status_subresource {
                return Err(ApiError::not_found_path(&rest.join("/")));
            }
            let body = ctx.json_body()?;
            let mut store = shared.store();
            let outcome = store.update(def, ns, name, body, sub, ctx.write_options()?)?;
            shared.notify(&store);
            Ok(with_warnings(
                json_response(200, &outcome.object),
                &outcome.warnings,
            ))
        }
        (Some(name), sub @ (None | Some("status")), Method::PATCH) => {
            if sub.is_some() && !def.status_subresource {
                return Err(ApiError::not_found_path(&rest.join("/")));
            }
            let patch_type = PatchType::from_content_type(&ctx.content_type)
                .ok_or_else(|| ApiError::unsupported_media_type(&ctx.content_type))?;
            let mut store = shared.store();
            let outcome = store.patch(
                def,
                ns,
                name,
                patch_type,
                &ctx.body,
                sub,
                ctx.write_options()?,
            )?;
            shared.notify(&store);
            let code = if outcome.created { 201 } else { 200 };
            Ok(with_warnings(
                json_response(code, &outcome.object),
                &outcome.warnings,
            ))
        }
        (Some(name), None, Method::DELETE) => {
            let options = ctx.delete_options()?;
            let mut store = shared.store();
            let object = store.delete_with(def, ns, name, &options)?;
            shared.notify(&store);
            Ok(json_response(200, &object))
        }
        (Some(name), Some("binding"), Method::POST)
            if def.group.is_empty() && def.plural == "pods" =>
        {
            let body = ctx.json_body()?;
            let mut store = shared.store();
            store.bind_pod(ns.unwrap_or("default"), name, &body)?;
            shared.notify(&store);
            Ok(json_response(
                201,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}),
            ))
        }
        (_, Some("status") | Some("binding") | None, method) => Err(ApiError::method_not_allowed(
            format!("the server does not allow this method ({method}) on the requested resource"),
        )),
        _ => Err(ApiError::not_found_path(&rest.join("/"))),
    }
}

/// The `meta.k8s.io/v1` PartialObjectMetadata of an object.
fn partial_metadata(object: &Value) -> Value {
    json!({
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": object.get("metadata").cloned().unwrap_or(json!({})),
    })
}

struct WatchFilter {
    def: ResourceDef,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
    table: bool,
    metadata_only: bool,
    include: String,
}

impl WatchFilter {
    fn encode(&self, event_type: &str, object: &Value) -> Bytes {
        let mut object = Store::present(&self.def, object);
        if self.table {
            let rv = object
                .pointer("/metadata/resourceVersion")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            object = table::table(&self.def, &[object], &rv, &self.include);
        } else if self.metadata_only {
            object = partial_metadata(&object);
        }
        let mut line =
            serde_json::to_vec(&json!({"type": event_type, "object": object})).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }

    fn matches(&self, object: &Value) -> bool {
        self.labels.matches(object) && self.fields.matches(object)
    }

    /// The event this watcher sees for a stored event, if any.
    fn translate(&self, event: &StoredEvent) -> Option<Bytes> {
        if event.key != self.def.storage_key() {
            return None;
        }
        if let Some(ns) = &self.namespace {
            if self.def.namespaced && &event.namespace != ns {
                return None;
            }
        }
        let now = self.matches(&event.object);
        let event_type = match event.event_type {
            EventType::Added | EventType::Deleted => now.then_some(event.event_type.as_str())?,
            EventType::Modified => {
                let before = event.old.as_ref().is_some_and(|o| self.matches(o));
                match (before, now) {
                    (true, true) => "MODIFIED",
                    (false, true) => "ADDED",
                    (true, false) => "DELETED",
                    (false, false) => return None,
                }
            }
        };
        Some(self.encode(event_type, &event.object))
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut metadata = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        let object = json!({"kind": self.def.kind, "apiVersion": self.def.api_version(), "metadata": metadata});
        let mut line =
            serde_json::to_vec(&json!({"type": "BOOKMARK", "object": object})).unwrap_or_default();
        line.push(b'\n');
        Bytes::from(line)
    }
}

fn stream_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures::StreamExt::map(ReceiverStream::new(rx), Ok::<Bytes, Infallible>);
    let mut response = Response::new(Body::from_stream(stream));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn start_watch(
    shared: &Arc<Shared>,
    ctx: &RequestContext,
    def: ResourceDef,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
) -> Result<Response, ApiError> {
    let filter = WatchFilter {
        def,
        namespace,
        labels,
        fields,
        table: ctx.wants_table(),
        metadata_only: ctx.wants_metadata(),
        include: ctx.param("includeObject").unwrap_or_default().to_string(),
    };
    let send_initial = ctx.param("sendInitialEvents") == Some("true");
    let bookmarks = ctx.flag("allowWatchBookmarks");
    let timeout = ctx
        .param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    let requested_rv = ctx.param("resourceVersion").unwrap_or_default().to_string();
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let mut changes = shared.changes.subscribe();
    let (initial, start_rv) = {
        let store = shared.store();
        let current = store.current_rv();
        if send_initial || requested_rv.is_empty() || requested_rv == "0" {
            let items = store.list(
                &filter.def,
                filter.namespace.as_deref(),
                &filter.labels,
                &filter.fields,
            );
            let lines: Vec<Bytes> = items.iter().map(|o| filter.encode("ADDED", o)).collect();
            (lines, current)
        } else {
            let rv: u64 = requested_rv.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid resource version: {requested_rv:?}"))
            })?;
            if rv < store.oldest_resumable_rv() {
                let gone = ApiError::gone(format!(
                    "too old resource version: {rv} ({})",
                    store.oldest_resumable_rv()
                ));
                let mut line =
                    serde_json::to_vec(&json!({"type": "ERROR", "object": gone.to_status()}))
                        .unwrap_or_default();
                line.push(b'\n');
                let (tx, rx) = mpsc::channel(1);
                let _ = tx.try_send(Bytes::from(line));
                return Ok(stream_response(rx));
            }
            (Vec::new(), rv)
        }
    };
    let shared = Arc::clone(shared);
    tokio::spawn(async move {
        for line in initial {
            if tx.send(line).await.is_err() {
                return;
            }
        }
        if send_initial && bookmarks && tx.send(filter.bookmark(start_rv, true)).await.is_err() {
            return;
        }
        let mut last = start_rv;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
        let mut next_bookmark = tokio::time::Instant::now() + shared.bookmark_interval();
        loop {
            let (lines, seen) = {
                let store = shared.store();
                if last < store.oldest_resumable_rv() {
                    // The history this watch needs is gone: end it the way the real server does.
                    let gone = ApiError::gone(format!("too old resource version: {last}"));
                    let mut line =
                        serde_json::to_vec(&json!({"type": "ERROR", "object": gone.to_status()}))
                            .unwrap_or_default();
                    line.push(b'\n');
                    (vec![Bytes::from(line)], u64::MAX)
                } else {
                    let lines: Vec<Bytes> = store
                        .events_after(last)
                        .filter_map(|e| filter.translate(e))
                        .collect();
                    (lines, store.current_rv().max(last))
                }
            };
            for line in lines {
                if tx.send(line).await.is_err() {
                    return;
                }
            }
            if seen == u64::MAX {
                return;
            }
            last = seen;
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep_until(next_bookmark), if bookmarks => {
                    next_bookmark = tokio::time::Instant::now() + shared.bookmark_interval();
                    if tx.send(filter.bookmark(last, false)).await.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return,
                _ = tx.closed() => return,
            }
        }
    });
    Ok(stream_response(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query(Some("labelSelector=app%3Dweb%2Ctier+in+%28a%29&watch=1&x"));
        assert_eq!(q["labelSelector"], "app=web,tier in (a)");
        assert_eq!(q["watch"], "1");
        assert_eq!(q["x"], "");
    }
}
