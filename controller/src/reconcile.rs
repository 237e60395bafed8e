//! The controller loop: list what is there, plan what should be (pure modules), apply the difference.
//!
//! Each pass reads fresh lists instead of caches, so a pass never acts on a state older than its own
//! last write; watches only say *when* to run a pass. One failing object is logged and retried with
//! backoff, the rest of the pass goes on.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use gpupool_api::crd::{ComputeProfile, GpuModel};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaimTemplate, ResourceSlice};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Client, CustomResourceExt, Resource};
use serde::de::DeserializeOwned;
use thiserror::Error;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::leader::Leadership;
use crate::metrics::ControllerMetrics;
use crate::models::{self, ClassOptions, PublishedDevice, ALL_GPUS_CLASS};
use crate::owner::{self, Owner};
use crate::plan::{self, ClassAction, TemplateAction};
use crate::profiles::{self, NamespaceInfo, ServableModel};

#[derive(Debug, Error)]
pub enum ReconcileError {
    #[error("listing {kind}: {source}")]
    List {
        kind: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("installing CRD {name}: {source}")]
    InstallCrd {
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// One object the pass could not write; the pass goes on with the others and is retried.
#[derive(Debug, Error)]
#[error("{object}: {action}")]
pub struct WriteError {
    /// `<Kind> <name>` or `<Kind> <namespace>/<name>`, as kubectl names it.
    pub object: String,
    pub action: WriteFailure,
}

#[derive(Debug, Error)]
pub enum WriteFailure {
    /// Another replica took the lease: this one stops writing at once.
    #[error("not the leader any more")]
    NotLeader,
    #[error("{verb}: {source}")]
    Api {
        verb: &'static str,
        #[source]
        source: kube::Error,
    },
}

impl WriteError {
    fn api(object: String, verb: &'static str) -> impl FnOnce(kube::Error) -> WriteError {
        move |source| WriteError {
            object,
            action: WriteFailure::Api { verb, source },
        }
    }
}

#[derive(Debug, Clone)]
pub struct Settings {
    /// Set `extendedResourceName` on model classes (turned off for good if the API refuses it).
    pub extended_resources: bool,
    /// A full pass at least this often, even without watch events.
    pub resync: Duration,
    /// Wait this long after a watch event so that a burst of events makes one pass.
    pub debounce: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            extended_resources: true,
            resync: Duration::from_secs(30),
            debounce: Duration::from_millis(100),
        }
    }
}

/// What a pass did.
#[derive(Debug, Default)]
pub struct PassReport {
    pub writes: u64,
    /// Each object that could not be written; retried with backoff.
    pub failures: Vec<WriteError>,
}

/// Exponential backoff between failed passes.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Backoff {
            first,
            max,
            next: first,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

pub struct Reconciler {
    client: Client,
    leadership: Leadership,
    settings: Settings,
    extended_resources: AtomicBool,
    writes: Arc<AtomicU64>,
    metrics: Option<Arc<ControllerMetrics>>,
    /// Owner of the all-GPUs class, which no GpuModel owns (see `owner`).
    class_owner: Option<Owner>,
}

fn patch_params() -> PatchParams {
    PatchParams::default()
}

/// Whether the API server refused `extendedResourceName` (an older API, or the feature off).
fn refuses_extended_resource_name(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status)
        if matches!(status.code, 400 | 422) && status.message.contains("extendedResourceName"))
}

async fn list<K>(client: &Client, kind: &'static str) -> Result<Vec<K>, ReconcileError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    Api::<K>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .map_err(|source| ReconcileError::List { kind, source })
}

impl Reconciler {
    pub fn new(client: Client, leadership: Leadership, settings: Settings) -> Self {
        Reconciler {
            client,
            leadership,
            extended_resources: AtomicBool::new(settings.extended_resources),
            settings,
            writes: Arc::new(AtomicU64::new(0)),
            metrics: None,
            class_owner: None,
        }
    }

    /// Give the all-GPUs class `owner`, so that it goes when the install does.
    pub fn with_class_owner(mut self, owner: Owner) -> Self {
        self.class_owner = Some(owner);
        self
    }

    /// Count passes and export the pool per model there.
    pub fn with_metrics(mut self, metrics: Arc<ControllerMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Count of writes to the API server (objects and statuses), for tests and logs.
    pub fn writes(&self) -> Arc<AtomicU64> {
        self.writes.clone()
    }

    fn disable_extended_resources(&self, why: &str) {
        if self.extended_resources.swap(false, Ordering::SeqCst) {
            warn!(
                reason = %why,
                "the API server does not take DeviceClass extendedResourceName; managing classes without it"
            );
        }
    }

    /// Leader check right before each write: a replica that lost the lease stops at once.
    fn may_write(&self, object: impl FnOnce() -> String) -> Result<(), WriteError> {
        if self.leadership.is_leader() {
            self.writes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        } else {
            Err(WriteError {
                object: object(),
                action: WriteFailure::NotLeader,
            })
        }
    }

    /// One full reconcile of every object the controller manages.
    pub async fn pass(&self) -> Result<PassReport, ReconcileError> {
        let client = &self.client;
        let gpumodels: Vec<GpuModel> = list(client, "gpumodels.gpupool.dev").await?;
        let computeprofiles: Vec<ComputeProfile> =
            list(client, "computeprofiles.gpupool.dev").await?;
        let slices: Vec<ResourceSlice> = list(client, "resourceslices").await?;
        let namespaces: Vec<Namespace> = list(client, "namespaces").await?;
        let classes: Vec<DeviceClass> = list(client, "deviceclasses").await?;
        let templates: Vec<ResourceClaimTemplate> = list(client, "resourceclaimtemplates").await?;

        let devices: Vec<PublishedDevice> = models::published_devices(&slices);
        if let Some(metrics) = &self.metrics {
            metrics.set_pools(crate::metrics::pool_by_model(&devices));
        }
        let options = ClassOptions {
            extended_resources: self.extended_resources.load(Ordering::SeqCst),
        };
        // Names held by DeviceClasses we do not manage: never overwritten, and a Conflict for the
        // GpuModel that wants one.
        let taken: BTreeSet<String> = classes
            .iter()
            .filter(|c| !plan::is_managed(&c.metadata))
            .filter_map(|c| c.metadata.name.clone())
            .collect();
        let mut model_plan = models::plan_with_taken(&gpumodels, &devices, options, &taken);
        self.own_all_gpus_class(&mut model_plan.classes, &classes)
            .await;
        let class_actions = plan::diff_classes(&model_plan.classes, &classes);

        let servable = ServableModel::from_outcomes(&model_plan.outcomes);
        let namespace_infos: Vec<NamespaceInfo> = namespaces
            .iter()
            .map(|ns| NamespaceInfo {
                name: ns.metadata.name.clone().unwrap_or_default(),
                labels: ns.metadata.labels.clone().unwrap_or_default(),
                terminating: ns.metadata.deletion_timestamp.is_some()
                    || ns.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Terminating"),
            })
            .collect();
        let profile_outcomes: Vec<(profiles::ProfileOutcome, &ComputeProfile)> = computeprofiles
            .iter()
            .map(|p| (profiles::plan(p, &servable, &namespace_infos), p))
            .collect();
        let desired_templates: Vec<ResourceClaimTemplate> = profile_outcomes
            .iter()
            .flat_map(|(outcome, profile)| {
                outcome
                    .namespaces
                    .iter()
                    .filter_map(|ns| outcome.template_in(ns, profile.metadata.uid.as_deref()))
            })
            .collect();
        let template_actions = plan::diff_templates(&desired_templates, &templates);

        let mut report = PassReport::default();
        let writes_before = self.writes.load(Ordering::SeqCst);

        let (class_deletes, class_writes): (Vec<_>, Vec<_>) = class_actions
            .into_iter()
            .partition(|a| matches!(a, ClassAction::Delete(_)));
        let (template_deletes, template_writes): (Vec<_>, Vec<_>) = template_actions
            .into_iter()
            .partition(|a| matches!(a, TemplateAction::Delete { .. }));
        for action in class_writes.into_iter().chain(class_deletes) {
            if let Err(e) = self.apply_class(action).await {
                report.failures.push(e);
            }
        }
        for action in template_writes.into_iter().chain(template_deletes) {
            if let Err(e) = self.apply_template(action).await {
                report.failures.push(e);
            }
        }

        let now = Time(Timestamp::now());
        let model_api = Api::<GpuModel>::all(client.clone());
        for outcome in &model_plan.outcomes {
            let Some(model) = gpumodels
                .iter()
                .find(|m| m.metadata.name.as_deref() == Some(outcome.name.as_str()))
            else {
                continue;
            };
            let status = outcome.status(model.status.as_ref(), &now);
            let old = model.status.as_ref();
            if let Err(e) = self
                .write_status(&model_api, &outcome.name, old, &status, "GpuModel")
                .await
            {
                report.failures.push(e);
            }
        }
        let profile_api = Api::<ComputeProfile>::all(client.clone());
        for (outcome, profile) in &profile_outcomes {
            let status = outcome.status(profile.status.as_ref(), &now);
            let old = profile.status.as_ref();
            if let Err(e) = self
                .write_status(&profile_api, &outcome.name, old, &status, "ComputeProfile")
                .await
            {
                report.failures.push(e);
            }
        }
        report.writes = self.writes.load(Ordering::SeqCst) - writes_before;
        Ok(report)
    }

    /// Owner references of the desired all-GPUs class: those it has, plus the install's ClusterRole.
    /// The role is read again when the class is to be created, once when it is to be added to a
    /// class that lacks it (an upgrade from a version without owners), else not at all.
    async fn own_all_gpus_class(&self, desired: &mut [DeviceClass], existing: &[DeviceClass]) {
        let Some(wanted) = desired
            .iter_mut()
            .find(|c| c.metadata.name.as_deref() == Some(ALL_GPUS_CLASS))
        else {
            return;
        };
        let current = existing
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(ALL_GPUS_CLASS));
        // Whoever else owns the class keeps owning it; a class that is not ours is left alone anyway.
        let references = current
            .and_then(|c| c.metadata.owner_references.clone())
            .unwrap_or_default();
        let owner = match (&self.class_owner, current) {
            (None, _) => None,
            (Some(_), Some(class)) if !plan::is_managed(&class.metadata) => None,
            (Some(owner), None) => owner.refresh().await,
            (Some(owner), Some(_)) if references.iter().any(|r| owner.is(r)) => None,
            (Some(owner), Some(_)) => owner.reference().await,
        };
        wanted.metadata.owner_references = owner::with_owner(&references, owner);
    }

    /// Patch the status of `name` from `old` to `new`; nothing to write when they are the same.
    async fn write_status<K, S>(
        &self,
        api: &Api<K>,
        name: &str,
        old: Option<&S>,
        new: &S,
        kind: &str,
    ) -> Result<(), WriteError>
    where
        K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
        S: serde::Serialize,
    {
        let Some(patch) = plan::status_patch(old, new) else {
            return Ok(());
        };
        let object = || format!("{kind} {name}");
        self.may_write(object)?;
        api.patch_status(name, &patch_params(), &Patch::Merge(&patch))
            .await
            .map(|_| debug!(kind, name, "status written"))
            .map_err(WriteError::api(object(), "status"))
    }

    async fn apply_class(&self, action: ClassAction) -> Result<(), WriteError> {
        let api = Api::<DeviceClass>::all(self.client.clone());
        match action {
            ClassAction::Foreign(_) => Ok(()),
            ClassAction::Delete(name) => {
                let object = || format!("DeviceClass {name}");
                self.may_write(object)?;
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {
                        info!(class = %name, "deleted DeviceClass (its source is gone)");
                        Ok(())
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    Err(e) => Err(WriteError::api(object(), "delete")(e)),
                }
            }
            ClassAction::Create(class) | ClassAction::Replace(class) => {
                let replace = class.metadata.resource_version.is_some();
                let mut class = class;
                loop {
                    let name = class.metadata.name.clone().unwrap_or_default();
                    let object = || format!("DeviceClass {name}");
                    self.may_write(object)?;
                    let result = if replace {
                        api.replace(&name, &PostParams::default(), &class).await
                    } else {
                        api.create(&PostParams::default(), &class).await
                    };
                    let sent_extended = class.spec.extended_resource_name.is_some();
                    match result {
                        Ok(stored) => {
                            info!(class = %name, "{} DeviceClass", if replace { "updated" } else { "created" });
                            if sent_extended && stored.spec.extended_resource_name.is_none() {
                                // Dropped silently (an API that prunes unknown fields): the next pass
                                // rewrites the class without it, once.
                                self.disable_extended_resources("field dropped by the API server");
                            }
                            return Ok(());
                        }
                        Err(e) if sent_extended && refuses_extended_resource_name(&e) => {
                            self.disable_extended_resources(&e.to_string());
                            class.spec.extended_resource_name = None;
                            plan::restamp_class(&mut class);
                        }
                        Err(e) => {
                            let verb = if replace { "replace" } else { "create" };
                            return Err(WriteError::api(object(), verb)(e));
                        }
                    }
                }
            }
        }
    }

    async fn apply_template(&self, action: TemplateAction) -> Result<(), WriteError> {
        match action {
            TemplateAction::Foreign { namespace, name } => {
                debug!(%namespace, %name, "a ResourceClaimTemplate of a profile's name exists and is not ours; left alone");
                Ok(())
            }
            TemplateAction::Delete { namespace, name } => {
                let object = || format!("ResourceClaimTemplate {namespace}/{name}");
                self.may_write(object)?;
                match Api::<ResourceClaimTemplate>::namespaced(self.client.clone(), &namespace)
                    .delete(&name, &DeleteParams::default())
                    .await
                {
                    Ok(_) => {
                        info!(%namespace, %name, "deleted ResourceClaimTemplate (its profile no longer serves here)");
                        Ok(())
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                    Err(e) => Err(WriteError::api(object(), "delete")(e)),
                }
            }
            TemplateAction::Create(template) => {
                self.write_template(&template, false, "created", "create")
                    .await
            }
            TemplateAction::Replace(template) => {
                self.write_template(&template, true, "updated labels", "replace")
                    .await
            }
            TemplateAction::Recreate(template) => {
                // The spec of a ResourceClaimTemplate is immutable.
                let name = template.metadata.name.clone().unwrap_or_default();
                self.may_write(|| template_object(&template))?;
                match template_api(&self.client, &template)
                    .delete(&name, &DeleteParams::default())
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => {
                        return Err(WriteError::api(
                            template_object(&template),
                            "delete for recreate",
                        )(e))
                    }
                }
                self.write_template(
                    &template,
                    false,
                    "recreated with the new spec",
                    "create after delete",
                )
                .await
            }
        }
    }

    /// Create `template`, or replace it, in its namespace: `done` is logged when it is written,
    /// `verb` names the write when it fails.
    async fn write_template(
        &self,
        template: &ResourceClaimTemplate,
        replace: bool,
        done: &str,
        verb: &'static str,
    ) -> Result<(), WriteError> {
        let api = template_api(&self.client, template);
        self.may_write(|| template_object(template))?;
        let result = if replace {
            let name = template.metadata.name.clone().unwrap_or_default();
            api.replace(&name, &PostParams::default(), template).await
        } else {
            api.create(&PostParams::default(), template).await
        };
        result
            .map(|_| info!(template = %template_object(template), "{done}"))
            .map_err(WriteError::api(template_object(template), verb))
    }

    /// Pass after pass until `shutdown`: on watch events, on gaining leadership, every resync
    /// interval, and with backoff after failures. Only the leader passes.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let notify = Arc::new(Notify::new());
        let watchers = vec![
            self.spawn_trigger::<GpuModel>(&notify, "gpumodels"),
            self.spawn_trigger::<ComputeProfile>(&notify, "computeprofiles"),
            self.spawn_trigger::<ResourceSlice>(&notify, "resourceslices"),
            self.spawn_trigger::<Namespace>(&notify, "namespaces"),
            self.spawn_trigger::<DeviceClass>(&notify, "deviceclasses"),
            self.spawn_trigger::<ResourceClaimTemplate>(&notify, "resourceclaimtemplates"),
        ];
        let mut leader = self.leadership.subscribe();
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        let mut next_pass = Instant::now();
        loop {
            let stop = tokio::select! {
                _ = notify.notified() => {
                    tokio::time::sleep(self.settings.debounce).await;
                    false
                }
                _ = tokio::time::sleep_until(next_pass) => false,
                changed = leader.changed() => changed.is_err(),
                // A dropped sender means nobody can ask us to go on: stop too.
                changed = shutdown.changed() => changed.is_err(),
            };
            if stop || *shutdown.borrow() {
                break;
            }
            if !self.leadership.is_leader() {
                // Only the leader's figures are current; a follower shows none rather than old ones.
                if let Some(metrics) = &self.metrics {
                    metrics.set_pools(Default::default());
                }
                next_pass = Instant::now() + self.settings.resync;
                continue;
            }
            let outcome = self.pass().await;
            if let Some(metrics) = &self.metrics {
                metrics.pass_done(!matches!(&outcome, Ok(report) if report.failures.is_empty()));
            }
            match outcome {
                Ok(report) if report.failures.is_empty() => {
                    if report.writes > 0 {
                        debug!(writes = report.writes, "pass done");
                    }
                    backoff.reset();
                    next_pass = Instant::now() + self.settings.resync;
                }
                Ok(_) if !self.leadership.is_leader() => {
                    info!("leadership lost during a pass; the new leader carries on");
                    next_pass = Instant::now() + self.settings.resync;
                }
                Ok(report) => {
                    let delay = backoff.next_delay();
                    for failure in &report.failures {
                        warn!(retry_in = ?delay, "{failure}");
                    }
                    next_pass = Instant::now() + delay;
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    warn!(retry_in = ?delay, error = %e, "reconcile pass failed");
                    next_pass = Instant::now() + delay;
                }
            }
        }
        for w in watchers {
            w.abort();
        }
    }

    /// Watch every object of kind `K` in the background, waking the loop on each event.
    fn spawn_trigger<K>(&self, notify: &Arc<Notify>, kind: &'static str) -> JoinHandle<()>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let events = watcher(
            Api::<K>::all(self.client.clone()),
            watcher::Config::default(),
        );
        tokio::spawn(trigger_on(events, notify.clone(), kind))
    }
}

/// The API of a template's namespace.
fn template_api(client: &Client, template: &ResourceClaimTemplate) -> Api<ResourceClaimTemplate> {
    Api::namespaced(
        client.clone(),
        template.metadata.namespace.as_deref().unwrap_or_default(),
    )
}

/// `ResourceClaimTemplate <namespace>/<name>`, as kubectl names it.
fn template_object(template: &ResourceClaimTemplate) -> String {
    format!(
        "ResourceClaimTemplate {}/{}",
        template.metadata.namespace.as_deref().unwrap_or(""),
        template.metadata.name.as_deref().unwrap_or("")
    )
}

/// Turn every watch event of a kind into a wake-up of the loop.
async fn trigger_on<S, T>(stream: S, notify: Arc<Notify>, kind: &'static str)
where
    S: Stream<Item = Result<watcher::Event<T>, watcher::Error>> + Send,
{
    let mut events = std::pin::pin!(stream.default_backoff());
    while let Some(event) = events.next().await {
        match event {
            Ok(_) => notify.notify_one(),
            Err(e) => debug!(kind, error = %e, "watch failed; retrying"),
        }
    }
}

/// Create or update gpupool's CRDs (`--install-crds`, for clusters and sandboxes without the chart).
pub async fn install_crds(client: &Client) -> Result<(), ReconcileError> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    for mut crd in [GpuModel::crd(), ComputeProfile::crd()] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let err = |source| ReconcileError::InstallCrd {
            name: name.clone(),
            source,
        };
        match api.get_opt(&name).await.map_err(err)? {
            None => {
                api.create(&PostParams::default(), &crd)
                    .await
                    .map_err(err)?;
                info!(crd = %name, "installed CRD");
            }
            Some(existing) => {
                crd.metadata.resource_version = existing.metadata.resource_version;
                api.replace(&name, &PostParams::default(), &crd)
                    .await
                    .map_err(err)?;
                debug!(crd = %name, "CRD up to date");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(2));
        let delays: Vec<Duration> = (0..4).map(|_| b.next_delay()).collect();
        assert_eq!(delays, [500, 1000, 2000, 2000].map(Duration::from_millis));
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(500));
    }

    #[test]
    fn extended_resource_refusal_is_recognised() {
        let refusal = kube::Error::Api(Box::new(kube::core::Status {
            code: 400,
            message: r#"DeviceClass in version "v1" cannot be handled as a DeviceClass: strict decoding error: unknown field "spec.extendedResourceName""#.into(),
            reason: "BadRequest".into(),
            ..Default::default()
        }));
        assert!(refuses_extended_resource_name(&refusal));
        let other = kube::Error::Api(Box::new(kube::core::Status {
            code: 422,
            message: "spec.selectors[0].cel.expression: Invalid value".into(),
            ..Default::default()
        }));
        assert!(!refuses_extended_resource_name(&other));
    }
}
