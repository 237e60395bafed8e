//! Authorization as kube-apiserver 1.36 does it, seen through a kube-rs client with a
//! ServiceAccount's token: RBAC over the stored roles and bindings, and the DRA permissions a
//! claim's status write needs (the synthetic subresource `resourceclaims/driver` with the
//! node-aware verbs, with the refusal text kube-apiserver 1.36.2 was seen to answer, which
//! docs/architecture.md records).

use gpupool_apiserver::ApiServer;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

fn api_error<T: std::fmt::Debug>(result: Result<T, kube::Error>) -> Box<kube::core::Status> {
    match result {
        Err(kube::Error::Api(status)) => status,
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn create<K>(api: &Api<K>, object: Value)
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + serde::Serialize,
{
    let object: K = serde_json::from_value(object).unwrap();
    api.create(&PostParams::default(), &object).await.unwrap();
}

/// Grants ServiceAccount `gpupool/driver` the rules of a new ClusterRole `name`.
async fn grant(admin: &kube::Client, name: &str, rules: Value) {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    create(
        &Api::<ClusterRole>::all(admin.clone()),
        json!({"metadata": {"name": name}, "rules": rules}),
    )
    .await;
    create(
        &Api::<ClusterRoleBinding>::all(admin.clone()),
        json!({"metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "driver", "namespace": "gpupool"}]}),
    )
    .await;
}

#[tokio::test]
async fn rbac_decides_what_a_service_account_may_do() {
    let server = ApiServer::start().await.unwrap();
    let admin = server.client().await;
    let token = server.service_account_token("gpupool", "driver", Some("node-a"));
    let driver = server.client_with_token(&token).await;
    let slices: Api<ResourceSlice> = Api::all(driver.clone());

    let refused = api_error(slices.list(&ListParams::default()).await);
    assert_eq!((refused.code, refused.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        refused.message,
        "resourceslices.resource.k8s.io is forbidden: User \"system:serviceaccount:gpupool:driver\" \
         cannot list resource \"resourceslices\" in API group \"resource.k8s.io\" at the cluster scope"
    );

    grant(
        &admin,
        "slices",
        json!([{"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]},
               {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
                "resourceNames": ["mine"], "verbs": ["get"]}]),
    )
    .await;
    assert!(slices.list(&ListParams::default()).await.is_ok());
    // A verb the rule does not name.
    let refused = api_error(slices.get("any").await);
    assert_eq!(refused.code, 403);
    // resourceNames limit a rule to those objects.
    let claims: Api<ResourceClaim> = Api::namespaced(driver.clone(), "default");
    assert_eq!(
        api_error(claims.get("mine").await).code,
        404,
        "allowed, absent"
    );
    let refused = api_error(claims.get("theirs").await);
    assert_eq!(
        refused.message,
        "resourceclaims.resource.k8s.io \"theirs\" is forbidden: User \
         \"system:serviceaccount:gpupool:driver\" cannot get resource \"resourceclaims\" in API \
         group \"resource.k8s.io\" in the namespace \"default\""
    );

    // An unknown token is not a user at all.
    let stranger = server.client_with_token("not-issued").await;
    let status = api_error(
        Api::<ResourceSlice>::all(stranger)
            .list(&ListParams::default())
            .await,
    );
    assert_eq!((status.code, status.reason.as_str()), (401, "Unauthorized"));
}

/// Claim `c` in default, allocated on `node`'s pool with one share of gpu-0.
async fn allocated_claim(admin: &kube::Client, node: &str) -> Api<ResourceClaim> {
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), "default");
    create(
        &claims,
        json!({"metadata": {"name": "c"}, "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpupool.dev"}}]}}}),
    )
    .await;
    claims
        .patch_status(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "gpupool.dev", "pool": node,
                    "device": "gpu-0", "shareID": "3aef7919-0000-4000-8000-000000000001"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}})),
        )
        .await
        .unwrap();
    claims
}

fn device_status(pool: &str) -> Patch<Value> {
    Patch::Merge(
        json!({"status": {"devices": [{"driver": "gpupool.dev", "pool": pool,
        "device": "gpu-0", "shareID": "3aef7919-0000-4000-8000-000000000001",
        "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared", "message": "ok",
            "lastTransitionTime": "2026-12-01T00:00:00Z"}]}]}}),
    )
}

#[tokio::test]
async fn device_status_needs_the_driver_subresource_on_the_claims_node() {
    let server = ApiServer::start().await.unwrap();
    let admin = server.client().await;
    allocated_claim(&admin, "node-a").await;
    grant(
        &admin,
        "status",
        json!([{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"],
                "verbs": ["patch", "update"]}]),
    )
    .await;
    let on_a = server.service_account_token("gpupool", "driver", Some("node-a"));
    let claims: Api<ResourceClaim> =
        Api::namespaced(server.client_with_token(&on_a).await, "default");

    // resourceclaims/status alone is what a 1.36 cluster refuses (docs/architecture.md, observed).
    let refused = api_error(
        claims
            .patch_status("c", &PatchParams::default(), &device_status("node-a"))
            .await,
    );
    assert_eq!((refused.code, refused.reason.as_str()), (422, "Invalid"));
    assert!(
        refused.message.ends_with(
            "status.devices: Forbidden: changing status.devices requires \
             resource=\"resourceclaims/driver\", verb=\"[associated-node:patch arbitrary-node:patch]\" \
             permission: resourceclaims.resource.k8s.io \"gpupool.dev\" is forbidden: User \
             \"system:serviceaccount:gpupool:driver\" cannot arbitrary-node:patch resource \
             \"resourceclaims/driver\" in API group \"resource.k8s.io\" in the namespace \"default\""
        ),
        "{}",
        refused.message
    );

    // What deploy/base/driver-rbac.yaml grants.
    grant(
        &admin,
        "driver",
        json!([{"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
                "resourceNames": ["gpupool.dev"],
                "verbs": ["associated-node:patch", "associated-node:update"]}]),
    )
    .await;
    let written = claims
        .patch_status("c", &PatchParams::default(), &device_status("node-a"))
        .await
        .unwrap();
    assert_eq!(written.status.unwrap().devices.unwrap().len(), 1);

    // The same ServiceAccount on another node may not touch this claim: only arbitrary-node
    // applies there, and it was not granted.
    let on_b = server.service_account_token("gpupool", "driver", Some("node-b"));
    let from_b: Api<ResourceClaim> =
        Api::namespaced(server.client_with_token(&on_b).await, "default");
    let refused = api_error(
        from_b
            .patch_status(
                "c",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"devices": []}})),
            )
            .await,
    );
    assert!(
        refused
            .message
            .contains("verb=\"[arbitrary-node:patch]\" permission"),
        "{}",
        refused.message
    );
    // Nor may it allocate: that is the scheduler's (resourceclaims/binding).
    let refused = api_error(
        claims
            .patch_status(
                "c",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"reservedFor": [
                    {"resource": "pods", "name": "p", "uid": "3aef7919-0000-4000-8000-00000000000f"}]}})),
            )
            .await,
    );
    assert!(
        refused
            .message
            .contains("resource=\"resourceclaims/binding\""),
        "{}",
        refused.message
    );
}
