//! Keeping a ValidatingWebhookConfiguration's `caBundle` in step with the CA this webhook made.
//!
//! Why the webhook does it itself (the default): the chart then needs nothing else installed (no
//! cert-manager) and the key never leaves the pod's memory (no Secret to read or to leak). The
//! configuration is read every interval and put back when it differs, so a `helm upgrade` that
//! renders it without a `caBundle` is repaired within one interval; meanwhile the API server cannot
//! reach the webhook and, `failurePolicy: Ignore`, admits without it (the driver still checks).
//! Its RBAC is `get` and `patch` of that one configuration, by name.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::ByteString;
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::{json, Value};
use tokio::sync::watch;
use tracing::{info, warn};

use super::stopped;

/// The JSON patch that sets `bundle` as the `caBundle` of every webhook of `config`, guarded by its
/// resourceVersion (a concurrent writer makes it fail, and the next pass reads again); `None` when
/// every webhook has it already.
pub fn patch(config: &ValidatingWebhookConfiguration, bundle: &str) -> Option<Value> {
    let wanted = ByteString(bundle.as_bytes().to_vec());
    let webhooks = config.webhooks.as_deref().unwrap_or(&[]);
    let mut ops = Vec::new();
    for (i, webhook) in webhooks.iter().enumerate() {
        if webhook.client_config.ca_bundle.as_ref() != Some(&wanted) {
            ops.push(json!({
                "op": "add",
                "path": format!("/webhooks/{i}/clientConfig/caBundle"),
                "value": wanted,
            }));
        }
    }
    if ops.is_empty() {
        return None;
    }
    let mut guarded = vec![json!({
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": config.metadata.resource_version,
    })];
    guarded.extend(ops);
    Some(Value::Array(guarded))
}

/// Puts `bundle` into the configuration `name` now, every `interval`, and whenever it changes,
/// until `stop`. A missing configuration (not installed yet, or uninstalled) is waited for.
pub async fn keep(
    client: kube::Client,
    name: String,
    mut bundle: watch::Receiver<String>,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client);
    loop {
        let wanted = bundle.borrow_and_update().clone();
        if let Err(e) = ensure(&api, &name, &wanted).await {
            warn!(configuration = %name, error = %e, "keeping the webhook's caBundle");
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            changed = bundle.changed() => if changed.is_err() { return },
            _ = stopped(&mut stop) => return,
        }
    }
}

async fn ensure(
    api: &Api<ValidatingWebhookConfiguration>,
    name: &str,
    bundle: &str,
) -> Result<(), kube::Error> {
    let Some(config) = api.get_opt(name).await? else {
        return Ok(());
    };
    let Some(ops) = patch(&config, bundle) else {
        return Ok(());
    };
    let ops = serde_json::from_value(ops).map_err(kube::Error::SerdeError)?;
    api.patch(name, &PatchParams::default(), &Patch::Json::<()>(ops))
        .await?;
    info!(configuration = %name, "caBundle set to this webhook's CA");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(bundles: &[Option<&str>]) -> ValidatingWebhookConfiguration {
        let webhooks: Vec<Value> = bundles
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let mut client_config = json!({"url": "https://127.0.0.1:1/validate"});
                if let Some(b) = b {
                    client_config["caBundle"] = json!(ByteString(b.as_bytes().to_vec()));
                }
                json!({
                    "name": format!("w{i}.gpupool.dev"), "clientConfig": client_config,
                    "sideEffects": "None", "admissionReviewVersions": ["v1"]
                })
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": "gpupool-webhook", "resourceVersion": "42"},
            "webhooks": webhooks
        }))
        .unwrap()
    }

    #[test]
    fn only_webhooks_out_of_step_are_patched_and_the_read_version_is_tested() {
        let ops = patch(&config(&[None, Some("PEM"), Some("old")]), "PEM").unwrap();
        assert_eq!(
            ops,
            json!([
                {"op": "test", "path": "/metadata/resourceVersion", "value": "42"},
                {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": "UEVN"},
                {"op": "add", "path": "/webhooks/2/clientConfig/caBundle", "value": "UEVN"},
            ])
        );
        assert_eq!(patch(&config(&[Some("PEM"), Some("PEM")]), "PEM"), None);
        assert_eq!(patch(&config(&[]), "PEM"), None);
    }
}
