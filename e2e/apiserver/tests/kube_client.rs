//! The emulator driven by a kube-rs client, the way gpupool-driver and gpupool-controller use it.

use std::time::Duration;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use gpupool_api::crd::GpuModel;
use gpupool_apiserver::ApiServer;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::runtime::watcher;
use kube::{CustomResourceExt, ResourceExt};
use serde_json::json;

/// A fresh emulator, and the ConfigMaps of its default namespace.
async fn start() -> (ApiServer, Api<ConfigMap>) {
    let server = ApiServer::start().await.unwrap();
    let api = Api::namespaced(server.client().await, "default");
    (server, api)
}

fn config_map(name: &str, labels: serde_json::Value) -> ConfigMap {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": labels}, "data": {"k": "v"}}),
    )
    .unwrap()
}

/// Creates the ConfigMap `name` with `labels`.
async fn create_config_map(
    api: &Api<ConfigMap>,
    name: &str,
    labels: serde_json::Value,
) -> ConfigMap {
    api.create(&PostParams::default(), &config_map(name, labels))
        .await
        .unwrap()
}

/// Creates the claim `name` for one device of the class gpupool.dev.
async fn create_claim(claims: &Api<ResourceClaim>, name: &str) -> ResourceClaim {
    let claim: ResourceClaim = serde_json::from_value(json!({"metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}]}}}))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap()
}

fn api_error(result: Result<impl std::fmt::Debug, kube::Error>) -> Box<kube::core::Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// A watch of `api` from the resourceVersion of a list made now, and that resourceVersion.
async fn watch_from_now(
    api: &Api<ConfigMap>,
) -> (
    String,
    BoxStream<'static, kube::Result<WatchEvent<ConfigMap>>>,
) {
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    (rv, stream)
}

/// The next item of a watcher stream, within 10 s.
async fn next_within_10s<S, T, E>(stream: &mut S) -> Option<T>
where
    S: futures::Stream<Item = Result<T, E>> + Unpin,
    E: std::fmt::Debug,
{
    tokio::time::timeout(Duration::from_secs(10), stream.try_next())
        .await
        .expect("a watcher event within 10s")
        .expect("no watcher error")
}

async fn next_event<S, K>(stream: &mut S) -> WatchEvent<K>
where
    S: futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin,
{
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("a watch event within 10s")
            .expect("the stream is open")
            .expect("a decodable event");
        if !matches!(event, WatchEvent::Bookmark(_)) {
            return event;
        }
    }
}

#[tokio::test]
async fn watch_sees_create_update_delete_in_order() {
    let (_server, api) = start().await;
    let (_, mut stream) = watch_from_now(&api).await;

    let created = create_config_map(&api, "w", json!({})).await;
    let mut changed = created.clone();
    changed.data = Some([("k".to_string(), "changed".to_string())].into());
    api.replace("w", &PostParams::default(), &changed)
        .await
        .unwrap();
    api.delete("w", &DeleteParams::default()).await.unwrap();

    match next_event(&mut stream).await {
        WatchEvent::Added(cm) => assert_eq!(cm.name_any(), "w"),
        other => panic!("expected Added, got {other:?}"),
    }
    match next_event(&mut stream).await {
        WatchEvent::Modified(cm) => assert_eq!(cm.data.unwrap()["k"], "changed"),
        other => panic!("expected Modified, got {other:?}"),
    }
    match next_event(&mut stream).await {
        WatchEvent::Deleted(cm) => assert_eq!(cm.name_any(), "w"),
        other => panic!("expected Deleted, got {other:?}"),
    }
}

#[tokio::test]
async fn stale_update_gets_409_conflict() {
    let (_server, api) = start().await;
    let original = create_config_map(&api, "c", json!({})).await;
    let mut first = original.clone();
    first.data = Some([("k".to_string(), "1".to_string())].into());
    let first = api
        .replace("c", &PostParams::default(), &first)
        .await
        .unwrap();
    assert_ne!(first.resource_version(), original.resource_version());

    let mut stale = original.clone();
    stale.data = Some([("k".to_string(), "2".to_string())].into());
    let status = api_error(api.replace("c", &PostParams::default(), &stale).await);
    assert_eq!((status.code, status.reason.as_str()), (409, "Conflict"));
    assert_eq!(api.get("c").await.unwrap().data.unwrap()["k"], "1");

    let duplicate = api_error(
        api.create(&PostParams::default(), &config_map("c", json!({})))
            .await,
    );
    assert_eq!(
        (duplicate.code, duplicate.reason.as_str()),
        (409, "AlreadyExists")
    );
    let missing = api_error(api.get("nope").await);
    assert_eq!((missing.code, missing.reason.as_str()), (404, "NotFound"));
}

#[tokio::test]
async fn generate_name_and_server_fields() {
    let (server, api) = start().await;
    let mut cm = config_map("", json!({}));
    cm.metadata.name = None;
    cm.metadata.generate_name = Some("gen-".into());
    let a = api.create(&PostParams::default(), &cm).await.unwrap();
    let b = api.create(&PostParams::default(), &cm).await.unwrap();
    assert!(a.name_any().starts_with("gen-") && a.name_any().len() == "gen-".len() + 5);
    assert_ne!(a.name_any(), b.name_any());
    assert!(a.uid().is_some());
    assert!(a.metadata.creation_timestamp.is_some());
    // A ConfigMap has no generation on kube-apiserver either.
    assert_eq!(a.metadata.generation, None);

    let elsewhere: Api<ConfigMap> = Api::namespaced(server.client().await, "missing-ns");
    let status = api_error(
        elsewhere
            .create(&PostParams::default(), &config_map("x", json!({})))
            .await,
    );
    assert_eq!(status.code, 404);
}

#[tokio::test]
async fn label_and_field_selectors_filter() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    for (name, app) in [("a", "web"), ("b", "db"), ("c", "web")] {
        create_config_map(&api, name, json!({"app": app})).await;
    }
    for (params, expected) in [
        (ListParams::default().labels("app=web"), &["a", "c"][..]),
        (ListParams::default().labels("app notin (web)"), &["b"]),
        (ListParams::default().fields("metadata.name=c"), &["c"]),
        (
            ListParams::default()
                .labels("app=web")
                .fields("metadata.name!=a"),
            &["c"],
        ),
    ] {
        let listed = api.list(&params).await.unwrap();
        let names: Vec<String> = listed.items.iter().map(|c| c.name_any()).collect();
        assert_eq!(names, expected, "{params:?}");
    }

    let slices: Api<ResourceSlice> = Api::all(client);
    for node in ["node-a", "node-b"] {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": format!("{node}-gpupool.dev")},
            "spec": {"driver": "gpupool.dev", "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": [{"name": "gpu-0"}]}
        }))
        .unwrap();
        slices.create(&PostParams::default(), &slice).await.unwrap();
    }
    let on_b = slices
        .list(&ListParams::default().fields("spec.nodeName=node-b,spec.driver=gpupool.dev"))
        .await
        .unwrap();
    assert_eq!(on_b.items.len(), 1);
    assert_eq!(on_b.items[0].spec.node_name.as_deref(), Some("node-b"));
}

#[tokio::test]
async fn runtime_watcher_sees_initial_list_then_changes() {
    let (_server, api) = start().await;
    create_config_map(&api, "before", json!({})).await;

    for config in [
        watcher::Config::default(),
        watcher::Config::default().streaming_lists(),
    ] {
        let mut events = watcher(api.clone(), config).boxed();
        let mut initial = Vec::new();
        loop {
            match next_within_10s(&mut events).await {
                Some(watcher::Event::Init) => {}
                Some(watcher::Event::InitApply(cm)) => initial.push(cm.name_any()),
                Some(watcher::Event::InitDone) => break,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(initial.contains(&"before".to_string()), "{initial:?}");

        let name = format!("after-{}", initial.len());
        create_config_map(&api, &name, json!({})).await;
        api.delete(&name, &DeleteParams::default()).await.unwrap();
        let mut seen = Vec::new();
        while seen.len() < 2 {
            match next_within_10s(&mut events).await {
                Some(watcher::Event::Apply(cm)) => seen.push(format!("apply {}", cm.name_any())),
                Some(watcher::Event::Delete(cm)) => seen.push(format!("delete {}", cm.name_any())),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(seen, [format!("apply {name}"), format!("delete {name}")]);
    }
}

#[tokio::test]
async fn watch_from_compacted_version_gets_410() {
    let (server, api) = start().await;
    create_config_map(&api, "a", json!({})).await;
    server.compact();
    let mut stream = api
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    match next_event(&mut stream).await {
        WatchEvent::Error(status) => assert_eq!(status.code, 410),
        other => panic!("expected a 410 error event, got {other:?}"),
    }
}

#[tokio::test]
async fn crd_then_custom_resources_with_status_subresource() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.create(&PostParams::default(), &GpuModel::crd())
        .await
        .unwrap();

    let models: Api<GpuModel> = Api::all(client.clone());
    let model: GpuModel = serde_json::from_value(json!({
        "apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuModel",
        "metadata": {"name": "a100"},
        "spec": {"model": "A100-SXM4-40GB", "computeWeight": 312},
        "status": {"devices": 99}
    }))
    .unwrap();
    let created = models.create(&PostParams::default(), &model).await.unwrap();
    assert_eq!(created.spec.compute_weight, 312);
    assert!(
        created.status.is_none_or(|s| s.devices == 0),
        "status is not set through the main endpoint"
    );

    let patched = models
        .patch_status(
            "a100",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"devices": 2, "nodes": 1}})),
        )
        .await
        .unwrap();
    assert_eq!(patched.status.as_ref().unwrap().devices, 2);
    assert_eq!(
        patched.metadata.generation,
        Some(1),
        "status changes keep the generation"
    );

    let respec = models
        .patch(
            "a100",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"computeWeight": 300}, "status": {"devices": 7}})),
        )
        .await
        .unwrap();
    assert_eq!(respec.spec.compute_weight, 300);
    assert_eq!(
        respec.status.unwrap().devices,
        2,
        "the main endpoint ignores status"
    );
    assert_eq!(respec.metadata.generation, Some(2));

    let strict = PostParams::default();
    let unknown = json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuModel", "metadata": {"name": "v100"},
        "spec": {"model": "V100", "computeWeight": 125, "colour": "green"}});
    let dynamic: Api<kube::core::DynamicObject> = Api::all_with(
        client.clone(),
        &kube::discovery::ApiResource::erase::<GpuModel>(&()),
    );
    let stored = dynamic
        .create(&strict, &serde_json::from_value(unknown).unwrap())
        .await
        .unwrap();
    assert!(
        stored.data["spec"].get("colour").is_none(),
        "unknown fields are pruned"
    );

    crds.delete("gpumodels.gpupool.dev", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(
        api_error(models.list(&ListParams::default()).await).code,
        404
    );
}

#[tokio::test]
async fn patches_and_server_side_apply() {
    let (_server, api) = start().await;
    let applied = api
        .patch(
            "ssa",
            &PatchParams::apply("gpupool-test"),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"a": "1"}})),
        )
        .await
        .unwrap();
    assert_eq!(applied.data.unwrap()["a"], "1");
    let json_patched = api
        .patch(
            "ssa",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(json!([{"op": "add", "path": "/data/b", "value": "2"}]))
                    .unwrap(),
            ),
        )
        .await
        .unwrap();
    assert_eq!(json_patched.data.unwrap()["b"], "2");
    let merged = api
        .patch(
            "ssa",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": null}})),
        )
        .await
        .unwrap();
    assert_eq!(merged.data.unwrap().keys().collect::<Vec<_>>(), ["b"]);
    let strategic = api
        .patch(
            "ssa",
            &PatchParams::default(),
            &Patch::Strategic(json!({"metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert_eq!(strategic.labels()["x"], "y");
}

#[tokio::test]
async fn invalid_slice_is_422_naming_the_field() {
    let server = ApiServer::start().await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client().await);
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": "bad"},
        "spec": {"driver": "gpupool.dev", "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": "gpu-0", "attributes": {"a_forty_character_attribute_name_xxxxxxx": {"int": 1}}}]}
    }))
    .unwrap();
    let status = api_error(slices.create(&PostParams::default(), &slice).await);
    assert_eq!((status.code, status.reason.as_str()), (422, "Invalid"));
    let causes = status.details.unwrap().causes;
    assert_eq!(
        causes[0].field,
        "spec.devices[0].attributes[a_forty_character_attribute_name_xxxxxxx]"
    );
}

#[tokio::test]
async fn claim_status_and_pod_binding() {
    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    create_claim(&claims, "c").await;
    let allocated = claims
        .patch_status(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": "gpupool.dev", "pool": "node-a", "device": "gpu-0"}]}}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        allocated
            .status
            .unwrap()
            .allocation
            .unwrap()
            .devices
            .unwrap()
            .results
            .unwrap()[0]
            .device,
        "gpu-0"
    );

    let pods: Api<Pod> = Api::namespaced(client, "default");
    let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]}}))
    .unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"}, "target": {"kind": "Node", "name": "node-a"}});
    let _: kube::core::Status = pods
        .create_subresource("binding", "p", &PostParams::default(), &binding)
        .await
        .unwrap();
    assert_eq!(
        pods.get("p")
            .await
            .unwrap()
            .spec
            .unwrap()
            .node_name
            .as_deref(),
        Some("node-a")
    );
}

#[tokio::test]
async fn stop_and_resume_serving_keeps_the_store() {
    let (server, api) = start().await;
    create_config_map(&api, "kept", json!({})).await;
    let writes_before = server
        .requests()
        .iter()
        .filter(|r| r.method == "POST")
        .count();
    assert_eq!(writes_before, 1);

    server.stop_serving().await;
    assert!(
        api.get("kept").await.is_err(),
        "nothing answers while stopped"
    );
    server.resume_serving().await.unwrap();
    let fresh: Api<ConfigMap> = Api::namespaced(server.client().await, "default");
    assert_eq!(fresh.get("kept").await.unwrap().name_any(), "kept");
    let post = server
        .requests()
        .into_iter()
        .find(|r| r.method == "POST")
        .unwrap();
    assert!(
        post.path
            .starts_with("/api/v1/namespaces/default/configmaps"),
        "{post:?}"
    );
}

#[tokio::test]
async fn recorder_events_show_as_core_events() {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    use kube::Resource;

    let server = ApiServer::start().await.unwrap();
    let client = server.client().await;
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "default");
    let claim = create_claim(&claims, "stuck").await;

    let recorder = Recorder::new(client.clone(), Reporter::from("gpupool-scheduler"));
    let event = Event {
        type_: EventType::Warning,
        reason: "FailedScheduling".into(),
        note: Some("no device fits".into()),
        action: "Allocate".into(),
        secondary: None,
    };
    recorder
        .publish(&event, &claim.object_ref(&()))
        .await
        .unwrap();
    recorder
        .publish(&event, &claim.object_ref(&()))
        .await
        .unwrap();

    let core: Api<CoreEvent> = Api::namespaced(client, "default");
    let selector = format!(
        "involvedObject.name=stuck,involvedObject.kind=ResourceClaim,involvedObject.uid={}",
        claim.uid().unwrap()
    );
    let events = core
        .list(&ListParams::default().fields(&selector))
        .await
        .unwrap()
        .items;
    assert_eq!(events.len(), 1, "the second publish updates the series");
    assert_eq!(events[0].message.as_deref(), Some("no device fits"));
    assert_eq!(events[0].reason.as_deref(), Some("FailedScheduling"));
    assert_eq!(events[0].series.as_ref().map(|s| s.count), Some(Some(2)));
}

#[tokio::test]
async fn dropping_the_server_stops_it() {
    let server = ApiServer::start().await.unwrap();
    let addr = server.url().trim_start_matches("http://").to_string();
    assert!(tokio::net::TcpStream::connect(&addr).await.is_ok());
    drop(server);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(tokio::net::TcpStream::connect(&addr).await.is_err());
}

#[tokio::test]
async fn metadata_calls_get_partial_object_metadata() {
    let (server, api) = start().await;
    create_config_map(&api, "m", json!({"app": "web"})).await;
    let listed = api.list_metadata(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].labels()["app"], "web");
    let one = api.get_metadata("m").await.unwrap();
    assert_eq!(one.types.as_ref().unwrap().kind, "PartialObjectMetadata");

    let mut events = watcher(
        Api::<kube::core::PartialObjectMeta<ConfigMap>>::namespaced(
            server.client().await,
            "default",
        ),
        watcher::Config::default(),
    )
    .boxed();
    let mut names = Vec::new();
    while names.is_empty() {
        if let Some(watcher::Event::InitApply(meta)) = next_within_10s(&mut events).await {
            names.push(meta.name_any());
        }
    }
    assert_eq!(names, ["m"]);
}

#[tokio::test]
async fn watches_that_allow_bookmarks_get_them_periodically() {
    let (server, api) = start().await;
    server.set_bookmark_interval(Duration::from_millis(100));
    let (rv, mut stream) = watch_from_now(&api).await;
    let event = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("a bookmark within 5s")
        .unwrap()
        .unwrap();
    match event {
        WatchEvent::Bookmark(bookmark) => assert_eq!(bookmark.metadata.resource_version, rv),
        other => panic!("expected a bookmark, got {other:?}"),
    }
}

#[tokio::test]
async fn the_default_namespace_cannot_be_deleted() {
    use k8s_openapi::api::core::v1::Namespace;
    let server = ApiServer::start().await.unwrap();
    let namespaces: Api<Namespace> = Api::all(server.client().await);
    let status = api_error(namespaces.delete("default", &DeleteParams::default()).await);
    assert_eq!((status.code, status.reason.as_str()), (403, "Forbidden"));
    assert!(namespaces.get("default").await.is_ok());
}

#[tokio::test]
async fn watchers_resume_after_an_api_outage() {
    use kube::runtime::WatchStreamExt;
    let (server, api) = start().await;
    let mut objects = watcher(api.clone(), watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    create_config_map(&api, "before-outage", json!({})).await;
    let first = next_within_10s(&mut objects).await.unwrap();
    assert_eq!(first.name_any(), "before-outage");

    server.stop_serving().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.resume_serving().await.unwrap();
    create_config_map(&api, "after-outage", json!({})).await;
    let mut seen = Vec::new();
    while !seen.contains(&"after-outage".to_string()) {
        let next = tokio::time::timeout(Duration::from_secs(20), objects.try_next())
            .await
            .expect("the watcher reconnects within 20s");
        if let Ok(Some(cm)) = next {
            seen.push(cm.name_any());
        }
    }
}

/// A ConfigMap `name` owned by `owner`.
fn owned_config_map(name: &str, owner: &ConfigMap) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name, "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": owner.name_any(),
        "uid": owner.uid().unwrap(),
    }]}}))
    .unwrap()
}

#[tokio::test]
async fn delete_propagation_reaches_the_dependents_as_the_request_asks() {
    let (server, api) = start().await;
    let exists = |name: &'static str| {
        let api = api.clone();
        async move { api.get_opt(name).await.unwrap().is_some() }
    };
    let pp = PostParams::default();

    // Background, kube-rs's and kubectl's default: the dependent goes with its owner.
    let owner = create_config_map(&api, "owner", json!({})).await;
    api.create(&pp, &owned_config_map("dependent", &owner))
        .await
        .unwrap();
    api.delete("owner", &DeleteParams::background())
        .await
        .unwrap();
    assert!(!exists("owner").await);
    assert!(!exists("dependent").await);

    // Orphan: the dependent stays, without the reference.
    let owner = create_config_map(&api, "owner", json!({})).await;
    api.create(&pp, &owned_config_map("dependent", &owner))
        .await
        .unwrap();
    api.delete("owner", &DeleteParams::orphan()).await.unwrap();
    assert!(!exists("owner").await);
    let kept = api.get("dependent").await.unwrap();
    assert_eq!(kept.metadata.owner_references, None);
    api.delete("dependent", &DeleteParams::default())
        .await
        .unwrap();

    // Foreground: nothing blocks, so both are gone once the DELETE has answered.
    let owner = create_config_map(&api, "owner", json!({})).await;
    api.create(&pp, &owned_config_map("dependent", &owner))
        .await
        .unwrap();
    api.delete("owner", &DeleteParams::foreground())
        .await
        .unwrap();
    assert!(!exists("owner").await);
    assert!(!exists("dependent").await);

    // Both ways of asking at once are refused, as upstream does.
    create_config_map(&api, "owner", json!({})).await;
    let both = DeleteParams {
        propagation_policy: Some(kube::api::PropagationPolicy::Orphan),
        ..DeleteParams::default()
    };
    let mut body = serde_json::to_value(&both).unwrap();
    body["orphanDependents"] = json!(true);
    let request = axum::http::Request::delete(format!(
        "{}/api/v1/namespaces/default/configmaps/owner",
        server.url()
    ))
    .header("content-type", "application/json")
    .body(serde_json::to_vec(&body).unwrap())
    .unwrap();
    let status = api_error(server.client().await.request::<ConfigMap>(request).await);
    assert_eq!(status.code, 422, "{status:?}");
    assert!(
        status.message.contains("cannot be both set"),
        "{}",
        status.message
    );
    assert!(exists("owner").await);
}

/// A GET with a resourceVersion is served from the watch cache once the cache has caught up with
/// that version (never an older copy), and one ahead of the store fails as the real server fails.
#[tokio::test]
async fn a_get_not_older_than_a_version_waits_for_the_cache() {
    use gpupool_apiserver::ApiServerOptions;
    use kube::api::GetParams;
    let lag = Duration::from_millis(300);
    let server = ApiServer::start_with(ApiServerOptions::default().cache_lag(lag))
        .await
        .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(server.client().await, "default");
    create_config_map(&api, "c", json!({})).await;
    tokio::time::sleep(lag).await;
    let mut changed = config_map("c", json!({"v": "2"}));
    changed.metadata.resource_version = None;
    let written = api
        .replace("c", &PostParams::default(), &changed)
        .await
        .unwrap();
    let version = written.resource_version().unwrap();
    let stale = api.get_with("c", &GetParams::any()).await.unwrap();
    assert_ne!(stale.resource_version().unwrap(), version, "the cache lags");

    let started = std::time::Instant::now();
    let fresh = api.get_with("c", &GetParams::at(&version)).await.unwrap();
    assert_eq!(fresh.resource_version().unwrap(), version);
    assert!(started.elapsed() >= lag / 2, "{:?}", started.elapsed());

    // Ahead of the store: the server waits 3 s, then answers 504 (kube-rs would retry a 504, so
    // this one is asked over a plain connection).
    let ahead = version.parse::<u64>().unwrap() + 1000;
    let addr = server.url().trim_start_matches("http://").to_string();
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            stream,
            "GET /api/v1/namespaces/default/configmaps/c?resourceVersion={ahead} HTTP/1.1\r\n\
             Host: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(answer.contains("Too large resource version"), "{answer}");
}
