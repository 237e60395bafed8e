//! gpupool's admission webhook on the real kube-apiserver v1.36 (the emulator has no admission
//! chain and calls no webhook): the webhook (`gpupool_controller::webhook`, what `gpupool-controller
//! webhook` runs) serves on loopback with the certificate it made, keeps the caBundle of the
//! ValidatingWebhookConfiguration from deploy/base/webhook.yaml (its clientConfig pointed at
//! loopback, everything else as shipped) with the RBAC shipped beside it, and then:
//! - every bad config of a table is refused at create with the field named, in claims, templates
//!   and classes, in v1, v1beta2 and v1beta1, and through the real kubectl as a user sees it;
//! - every claim, template and class in deploy/examples/ is admitted;
//! - objects without a gpupool.dev config never reach the webhook (matchConditions);
//! - with the webhook stopped, claims are still admitted (failurePolicy Ignore), gpupool's too;
//! - the binary as its Deployment runs it does the same: its CA into the caBundle, a refusal, and
//!   nothing waits on it once it is killed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpupool_controller::webhook::{self, CertSource, Settings};
use gpupool_e2e::harness::{
    apply_objects, find_binary, kubectl_path, own_plane_or_skip, parse_manifests, wait_for,
    ManagedProcess,
};
use gpupool_e2e::plane::PlaneOptions;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::DeviceClass;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};
use tokio::sync::watch;

const NS: &str = "webhook-test";
const CONFIGURATION: &str = "gpupool-webhook";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn gpu_config(extra: Value) -> Value {
    let mut config = json!({"apiVersion": "gpupool.dev/v1alpha1", "kind": "GpuConfig"});
    config
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    config
}

/// A claim of `version` with one request `gpu` asking for `capacity`, and `parameters` as its
/// gpupool config.
fn claim(version: &str, name: &str, capacity: Value, parameters: Value) -> Value {
    let selection = json!({"deviceClassName": "gpupool.dev", "capacity": {"requests": capacity}});
    let request = if version == "v1beta1" {
        let mut r = selection;
        r["name"] = json!("gpu");
        r
    } else {
        json!({"name": "gpu", "exactly": selection})
    };
    json!({
        "apiVersion": format!("resource.k8s.io/{version}"),
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {
            "requests": [request],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpupool.dev", "parameters": parameters}}]
        }}
    })
}

fn v1_claim(name: &str, capacity: Value, extra: Value) -> Value {
    claim("v1", name, capacity, gpu_config(extra))
}

fn template(name: &str, claim: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"spec": claim["spec"].clone()}
    })
}

fn class(name: &str, parameters: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {
            "selectors": [{"cel": {"expression": "device.driver == 'gpupool.dev'"}}],
            "config": [{"opaque": {"driver": "gpupool.dev", "parameters": parameters}}]
        }
    })
}

/// The bad examples: the object, and the text the refusal must carry (the field and what is
/// allowed there).
fn bad_examples() -> Vec<(&'static str, Value, String)> {
    let p = "spec.devices.config[0].opaque.parameters";
    let none = json!({});
    vec![
        ("unknown field", v1_claim("b-unknown", none.clone(), json!({"memoryLimt": "4Gi"})),
            format!("{p}.memoryLimt: unknown field")),
        ("coreLimit as a string", v1_claim("b-core-type", none.clone(), json!({"coreLimit": "50"})),
            format!("{p}.coreLimit: \"50\": must be an integer 0..100")),
        ("coreLimit 150", v1_claim("b-core-150", none.clone(), json!({"coreLimit": 150})),
            format!("{p}.coreLimit: 150: must be an integer 0..100")),
        ("coreLimit -1", v1_claim("b-core-neg", none.clone(), json!({"coreLimit": -1})),
            format!("{p}.coreLimit: -1: must be an integer 0..100")),
        ("memoryLimit lots", v1_claim("b-mem-lots", none.clone(), json!({"memoryLimit": "lots"})),
            format!("{p}.memoryLimit: invalid quantity \"lots\"")),
        ("memoryLimit as a boolean", v1_claim("b-mem-bool", none.clone(), json!({"memoryLimit": true})),
            format!("{p}.memoryLimit: true: must be a quantity such as \"8Gi\"")),
        ("memoryLimit below 1Mi", v1_claim("b-mem-small", none.clone(), json!({"memoryLimit": "1Ki"})),
            format!("{p}.memoryLimit: \"1Ki\": must be at least 1Mi")),
        ("memoryLimit in millibytes", v1_claim("b-mem-milli", none.clone(), json!({"memoryLimit": "500m"})),
            format!("{p}.memoryLimit: \"500m\": must be a whole number of bytes")),
        ("compute Mpss", v1_claim("b-mpss", none.clone(), json!({"compute": "Mpss"})),
            format!("{p}.compute: unsupported value \"Mpss\", expected \"Limiter\" or \"Mps\"")),
        ("sharing Shared", v1_claim("b-sharing", none.clone(), json!({"sharing": "Shared"})),
            format!("{p}.sharing: unsupported value \"Shared\", expected \"Exclusive\" or \"Fractional\"")),
        ("enforcement in lower case", v1_claim("b-enf", none.clone(), json!({"enforcement": "hamicore"})),
            format!("{p}.enforcement: unsupported value \"hamicore\"")),
        ("priority 2", v1_claim("b-prio", none.clone(), json!({"priority": 2})),
            format!("{p}.priority: 2: must be an integer 0 (high) or 1 (low)")),
        ("another apiVersion", claim("v1", "b-apiversion", none.clone(),
            json!({"apiVersion": "gpupool.dev/v1", "kind": "GpuConfig"})),
            format!("{p}.apiVersion: unsupported value \"gpupool.dev/v1\", expected \"gpupool.dev/v1alpha1\"")),
        ("no kind", claim("v1", "b-kind", none.clone(), json!({"apiVersion": "gpupool.dev/v1alpha1"})),
            format!("{p}.kind: required")),
        ("nested too deep", v1_claim("b-deep", none.clone(), json!({"sharing": {"a": {"b": {"c": {"d": 1}}}}})),
            format!("{p}: nested 5 levels deep, at most 4 allowed")),
        ("memoryLimit above the request", v1_claim("b-mem-above", json!({"memory": "8Gi"}), json!({"memoryLimit": "9Gi"})),
            format!("{p}.memoryLimit: 9Gi is above the 8Gi that request \"gpu\" asks for (spec.devices.requests[0].exactly.capacity.requests.memory)")),
        ("coreLimit above the request", v1_claim("b-core-above", json!({"cores": "50"}), json!({"coreLimit": 60})),
            format!("{p}.coreLimit: 60 is above the 50% that request \"gpu\" asks for")),
        ("MPS with a memory limit and no cores", v1_claim("b-mps-mem", none.clone(), json!({"compute": "Mps", "memoryLimit": "4Gi"})),
            format!("{p}.compute: Mps, but request \"gpu\" reserves no SMs")),
        ("MPS on a share without cores", v1_claim("b-mps-share", json!({"memory": "8Gi"}), json!({"compute": "Mps"})),
            format!("{p}.compute: Mps, but request \"gpu\" reserves no SMs")),
        ("MPS on two devices", {
            let mut c = v1_claim("b-mps-two", json!({"cores": "30"}), json!({"compute": "Mps"}));
            c["spec"]["devices"]["requests"][0]["exactly"]["count"] = json!(2);
            c
        }, format!("{p}.compute: Mps, but request \"gpu\" asks for 2 devices")),
        ("a v1beta1 claim", claim("v1beta1", "b-beta1", none.clone(), gpu_config(json!({"coreLimit": 150}))),
            format!("{p}.coreLimit: 150: must be an integer 0..100")),
        ("a v1beta1 claim above its inline request", claim("v1beta1", "b-beta1-above", json!({"memory": "2Gi"}), gpu_config(json!({"memoryLimit": "3Gi"}))),
            format!("{p}.memoryLimit: 3Gi is above the 2Gi that request \"gpu\" asks for (spec.devices.requests[0].capacity.requests.memory)")),
        ("a v1beta2 claim", claim("v1beta2", "b-beta2", none.clone(), gpu_config(json!({"compute": "Mpss"}))),
            format!("{p}.compute: unsupported value \"Mpss\"")),
        ("a template", template("b-template", v1_claim("x", none.clone(), json!({"memoryLimit": "lots"}))),
            "spec.spec.devices.config[0].opaque.parameters.memoryLimit: invalid quantity \"lots\"".to_string()),
        ("a template whose subrequest is smaller than the limit", template("b-template-sub", json!({"spec": {"devices": {
                "requests": [{"name": "gpu", "firstAvailable": [
                    {"name": "big", "deviceClassName": "gpupool.dev", "capacity": {"requests": {"memory": "16Gi"}}},
                    {"name": "small", "deviceClassName": "gpupool.dev", "capacity": {"requests": {"memory": "4Gi"}}}]}],
                "config": [{"opaque": {"driver": "gpupool.dev", "parameters": gpu_config(json!({"memoryLimit": "8Gi"}))}}]}}})),
            "spec.spec.devices.config[0].opaque.parameters.memoryLimit: 8Gi is above the 4Gi that request \"gpu/small\"".to_string()),
        ("a class", class("b-class.gpupool.dev", gpu_config(json!({"enforcement": "Full"}))),
            "DeviceClass \"b-class.gpupool.dev\": gpupool.dev config refused (the driver would fail the pod at prepare): spec.config[0].opaque.parameters.enforcement: unsupported value \"Full\"".to_string()),
    ]
}

fn plural(kind: &str) -> &'static str {
    match kind {
        "ResourceClaim" => "resourceclaims",
        "ResourceClaimTemplate" => "resourceclaimtemplates",
        "DeviceClass" => "deviceclasses",
        other => panic!("no plural known for {other}"),
    }
}

/// Creates `object` (a dry run with `dry_run`, which still calls the webhook: sideEffects None).
async fn create(client: &Client, object: &Value, dry_run: bool) -> Result<(), kube::Error> {
    let api_version = object["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.split_once('/').unwrap();
    let kind = object["kind"].as_str().unwrap();
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group, version, kind),
        plural(kind),
    );
    let api: Api<DynamicObject> = match object.pointer("/metadata/namespace") {
        Some(ns) => Api::namespaced_with(client.clone(), ns.as_str().unwrap(), &resource),
        None => Api::all_with(client.clone(), &resource),
    };
    let params = PostParams {
        dry_run,
        ..Default::default()
    };
    api.create(&params, &serde_json::from_value(object.clone()).unwrap())
        .await
        .map(|_| ())
}

fn refusal(result: Result<(), kube::Error>) -> Option<String> {
    match result {
        Err(kube::Error::Api(status)) => Some(status.message.clone()),
        _ => None,
    }
}

/// The shipped webhook configuration, its clientConfig pointed at `url`.
/// Waits until every webhook of the configuration carries `ca` as its caBundle.
async fn wait_for_ca_bundle(
    configurations: &Api<ValidatingWebhookConfiguration>,
    ca: &str,
    what: &str,
) {
    wait_for(what, Duration::from_secs(30), || async {
        let current = configurations.get(CONFIGURATION).await.ok()?;
        current
            .webhooks?
            .iter()
            .all(|w| {
                w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) == Some(ca.as_bytes())
            })
            .then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

fn shipped_configuration(url: &str) -> Value {
    let text = std::fs::read_to_string(deploy_dir().join("base/webhook.yaml")).unwrap();
    let mut configuration = parse_manifests(&text)
        .unwrap()
        .into_iter()
        .find(|o| o["kind"] == "ValidatingWebhookConfiguration")
        .expect("deploy/base/webhook.yaml has the webhook configuration");
    for webhook in configuration["webhooks"].as_array_mut().unwrap() {
        webhook["clientConfig"] = json!({"url": url});
    }
    configuration
}

/// The claims, templates and classes of every example file under deploy/examples (any depth).
fn example_objects() -> Vec<(String, Value)> {
    let mut files = Vec::new();
    let mut dirs = vec![deploy_dir().join("examples")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut objects = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for object in parse_manifests(&text).unwrap() {
            let kind = object["kind"].as_str().unwrap_or_default();
            if matches!(
                kind,
                "ResourceClaim" | "ResourceClaimTemplate" | "DeviceClass"
            ) {
                let name = format!(
                    "{} {kind}/{}",
                    file.strip_prefix(deploy_dir()).unwrap().display(),
                    object["metadata"]["name"].as_str().unwrap_or_default()
                );
                objects.push((name, object));
            }
        }
    }
    objects
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_refuses_bad_gpupool_configs_on_the_real_api_server() {
    let started = Instant::now();
    let Some(plane) = own_plane_or_skip("webhook", PlaneOptions::default().apiserver_only()).await
    else {
        return;
    };
    let admin = plane.admin_client().await.unwrap();
    for ns in [NS, "gpupool"] {
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap();
        let _ = Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &namespace)
            .await;
    }

    // The webhook runs as its ServiceAccount with the shipped RBAC: what it needs to keep the
    // caBundle is what the manifests grant.
    let shipped =
        parse_manifests(&std::fs::read_to_string(deploy_dir().join("base/webhook.yaml")).unwrap())
            .unwrap();
    let rbac: Vec<Value> = shipped
        .iter()
        .filter(|o| {
            matches!(
                o["kind"].as_str(),
                Some("ServiceAccount" | "ClusterRole" | "ClusterRoleBinding")
            )
        })
        .cloned()
        .collect();
    assert_eq!(
        rbac.len(),
        3,
        "webhook.yaml: ServiceAccount, ClusterRole, binding"
    );
    apply_objects(&admin, &rbac, "gpupool").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let webhook_kubeconfig = dir.path().join("webhook.kubeconfig");
    plane
        .service_account_kubeconfig(
            &admin,
            "gpupool",
            "gpupool-webhook",
            None,
            &webhook_kubeconfig,
        )
        .await
        .unwrap();
    let webhook_client = gpupool_e2e::harness::client_for_kubeconfig(&webhook_kubeconfig)
        .await
        .unwrap();

    let (stop, stopped) = watch::channel(false);
    let mut settings = Settings::new(
        "127.0.0.1:0".parse().unwrap(),
        CertSource::SelfSigned {
            hosts: vec!["127.0.0.1".into()],
            validity: Duration::from_secs(24 * 3600),
            webhook_configuration: Some(CONFIGURATION.into()),
        },
    );
    settings.ca_bundle_interval = Duration::from_millis(500);
    let running = webhook::start(settings, Some(webhook_client), stopped)
        .await
        .unwrap();
    let url = format!("https://{}/validate", running.addr);

    // Registered without a caBundle, as the chart installs it: the webhook puts its CA there.
    let configuration = shipped_configuration(&url);
    for webhook in configuration["webhooks"].as_array().unwrap() {
        assert_eq!(webhook["failurePolicy"], "Ignore");
        assert_eq!(webhook["sideEffects"], "None");
        assert_eq!(webhook["timeoutSeconds"], 5);
        assert!(webhook["clientConfig"].get("caBundle").is_none());
    }
    apply_objects(&admin, &[configuration], NS).await.unwrap();
    let ca = running.ca_bundle.as_ref().unwrap().borrow().clone();
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    wait_for_ca_bundle(&configurations, &ca, "the webhook to set its caBundle").await;

    // The API server reads webhook configurations through an informer: wait until it calls.
    let probe = v1_claim("probe", json!({}), json!({"coreLimit": 150}));
    wait_for(
        "the API server to call the webhook",
        Duration::from_secs(30),
        || async { refusal(create(&admin, &probe, true).await) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // The table: each refused at create, with its field and what is allowed.
    let examples = bad_examples();
    assert!(examples.len() >= 20, "{} bad examples", examples.len());
    let mut wrong = Vec::new();
    for (what, object, expected) in &examples {
        match refusal(create(&admin, object, false).await) {
            Some(message) if message.contains(expected.as_str()) => {
                let webhook = format!(
                    "admission webhook \"{}.gpupool.dev\" denied the request",
                    plural(object["kind"].as_str().unwrap())
                );
                if !message.contains(&webhook) {
                    wrong.push(format!("{what}: not refused by {webhook}: {message}"));
                }
            }
            Some(message) => wrong.push(format!(
                "{what}: refused, but with {message:?}, expected {expected:?}"
            )),
            None => wrong.push(format!("{what}: admitted")),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let refused = running
        .stats
        .refused
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        refused >= examples.len() as u64,
        "{refused} refusals counted"
    );

    // A class's spec may change: a change to a bad config is refused, an update that keeps the
    // spec (a label) is admitted.
    let classes: Api<DeviceClass> = Api::all(admin.clone());
    create(
        &admin,
        &class(
            "upd.gpupool.dev",
            gpu_config(json!({"enforcement": "None"})),
        ),
        false,
    )
    .await
    .unwrap();
    let bad_spec = json!({"spec": {"config": [{"opaque": {"driver": "gpupool.dev",
        "parameters": gpu_config(json!({"enforcement": "Off"}))}}]}});
    let message = refusal(
        classes
            .patch(
                "upd.gpupool.dev",
                &PatchParams::default(),
                &Patch::Merge(&bad_spec),
            )
            .await
            .map(|_| ()),
    )
    .expect("a class updated to a bad config is refused");
    assert!(
        message.contains("spec.config[0].opaque.parameters.enforcement: unsupported value \"Off\""),
        "{message}"
    );
    let reviews = running.stats.reviews();
    classes
        .patch(
            "upd.gpupool.dev",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"team": "a"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        running.stats.reviews(),
        reviews + 1,
        "the label update was reviewed, and admitted"
    );

    // A caBundle taken away (as an upgrade that renders the configuration might) is put back.
    let mut emptied = configurations.get(CONFIGURATION).await.unwrap();
    for webhook in emptied.webhooks.iter_mut().flatten() {
        webhook.client_config.ca_bundle = None;
    }
    configurations
        .replace(CONFIGURATION, &PostParams::default(), &emptied)
        .await
        .unwrap();
    wait_for_ca_bundle(&configurations, &ca, "the webhook to put its caBundle back").await;

    // As a user sees it: the real kubectl apply.
    match kubectl_path() {
        None => println!("webhook: kubectl not found; the kubectl refusal is not checked"),
        Some(kubectl) => {
            let file = dir.path().join("bad-claim.yaml");
            std::fs::write(
                &file,
                "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: half-a100\n  namespace: webhook-test\n\
                 spec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: gpupool.dev\n\
                 \x20       capacity:\n          requests:\n            memory: 8Gi\n    config:\n    - opaque:\n        driver: gpupool.dev\n\
                 \x20       parameters:\n          apiVersion: gpupool.dev/v1alpha1\n          kind: GpuConfig\n          coreLimit: 150\n",
            )
            .unwrap();
            let output = tokio::process::Command::new(kubectl)
                .args(["--kubeconfig"])
                .arg(plane.admin_kubeconfig())
                .args(["apply", "-f"])
                .arg(&file)
                .env("KUBECACHEDIR", dir.path().join("kubectl-cache"))
                .output()
                .await
                .unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            println!("kubectl apply of a bad claim prints:\n{stderr}");
            assert!(
                !output.status.success(),
                "kubectl apply succeeded: {stderr}"
            );
            assert!(
                stderr.contains("admission webhook \"resourceclaims.gpupool.dev\" denied the request: ResourceClaim \"webhook-test/half-a100\": gpupool.dev config refused")
                    && stderr.contains("spec.devices.config[0].opaque.parameters.coreLimit: 150: must be an integer 0..100"),
                "{stderr}"
            );
        }
    }

    // Every claim, template and class of deploy/examples is admitted (a dry run: the examples'
    // namespaces and names stay free).
    let mut refused_examples = Vec::new();
    let before = running.stats.reviews();
    let mut with_config = 0;
    for (name, mut object) in example_objects() {
        if object.pointer("/metadata/namespace").is_some() {
            object["metadata"]["namespace"] = json!(NS);
        }
        if object.to_string().contains("\"driver\":\"gpupool.dev\"") {
            with_config += 1;
        }
        if let Err(e) = create(&admin, &object, true).await {
            refused_examples.push(format!("{name}: {e}"));
        }
    }
    assert!(
        refused_examples.is_empty(),
        "{}",
        refused_examples.join("\n")
    );
    assert!(
        with_config > 0,
        "no example carries a gpupool config: the webhook saw none"
    );
    assert_eq!(
        running.stats.reviews() - before,
        with_config,
        "the examples with a gpupool config, and only they, were reviewed"
    );

    // Objects without gpupool config are not sent to the webhook at all.
    let mut plain = v1_claim("plain", json!({"memory": "8Gi"}), json!({}));
    plain["spec"]["devices"]
        .as_object_mut()
        .unwrap()
        .remove("config");
    let mut other_driver = v1_claim("other-driver", json!({}), json!({}));
    other_driver["spec"]["devices"]["config"][0]["opaque"] =
        json!({"driver": "gpu.example.com", "parameters": {"coreLimit": 150}});
    let mut plain_class = class("plain.example.com", json!({}));
    plain_class["spec"]
        .as_object_mut()
        .unwrap()
        .remove("config");
    let plain_template = template("plain", plain.clone());
    let before = running.stats.reviews();
    for object in [&plain, &other_driver, &plain_class, &plain_template] {
        create(&admin, object, false)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", object["metadata"]["name"]));
    }
    assert_eq!(
        running.stats.reviews(),
        before,
        "an object without gpupool.dev config reached the webhook"
    );
    let good = v1_claim(
        "good",
        json!({"memory": "8Gi", "cores": "50"}),
        json!({"memoryLimit": "4Gi", "coreLimit": 25}),
    );
    create(&admin, &good, false).await.unwrap();
    assert_eq!(
        running.stats.reviews(),
        before + 1,
        "a gpupool claim is reviewed"
    );

    // The webhook gone (its listener and its connections closed): nothing waits on it.
    let addr = running.addr;
    stop.send(true).unwrap();
    running.join().await;
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    let mut other_again = other_driver.clone();
    other_again["metadata"]["name"] = json!("other-driver-2");
    let mut plain_again = plain.clone();
    plain_again["metadata"]["name"] = json!("plain-2");
    let bad_while_down = v1_claim("bad-while-down", json!({}), json!({"coreLimit": 150}));
    let admitted_at = Instant::now();
    for object in [&other_again, &plain_again, &bad_while_down] {
        create(&admin, object, false).await.unwrap_or_else(|e| {
            panic!("{} with the webhook down: {e}", object["metadata"]["name"])
        });
    }
    // failurePolicy Ignore: a bad gpupool config is admitted too while the webhook is down; the
    // driver refuses it at prepare, naming the same field. A connection refused costs no timeout.
    assert!(
        admitted_at.elapsed() < Duration::from_secs(5),
        "admissions with the webhook down took {:?}",
        admitted_at.elapsed()
    );

    // The binary as its Deployment runs it (`gpupool-controller webhook`, self-signed, as its
    // ServiceAccount): it makes its own CA, puts it in the caBundle, refuses; killed as a pod is,
    // nothing waits on it.
    let binary = find_binary("gpupool-controller").unwrap_or_else(|e| panic!("{e}"));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut process = ManagedProcess::spawn(
        "gpupool-webhook",
        &binary,
        [
            "webhook",
            "--kubeconfig",
            webhook_kubeconfig.to_str().unwrap(),
            &format!("--listen=127.0.0.1:{port}"),
            "--cert-host=127.0.0.1",
            "--webhook-configuration",
            CONFIGURATION,
            "--ca-bundle-interval=1s",
        ]
        .map(String::from)
        .to_vec(),
        dir.path().join("webhook.log"),
    )
    .unwrap();
    let mut moved = configurations.get(CONFIGURATION).await.unwrap();
    for webhook in moved.webhooks.iter_mut().flatten() {
        webhook.client_config.url = Some(format!("https://127.0.0.1:{port}/validate"));
    }
    configurations
        .replace(CONFIGURATION, &PostParams::default(), &moved)
        .await
        .unwrap();
    let refused = wait_for(
        "the binary to refuse a bad claim",
        Duration::from_secs(30),
        || async { refusal(create(&admin, &probe, true).await) },
    )
    .await
    .unwrap_or_else(|e| {
        process.print_log_tail(30);
        panic!("{e}")
    });
    assert!(
        refused.contains("spec.devices.config[0].opaque.parameters.coreLimit: 150"),
        "{refused}"
    );
    process.kill();
    let admitted_at = Instant::now();
    let mut bad_after_kill = bad_while_down.clone();
    bad_after_kill["metadata"]["name"] = json!("bad-after-kill");
    create(&admin, &bad_after_kill, false)
        .await
        .unwrap_or_else(|e| panic!("with the webhook killed: {e}"));
    assert!(admitted_at.elapsed() < Duration::from_secs(5));
    println!("webhook test took {:?}", started.elapsed());
}
