//! The loop that plays kube-scheduler's DRA plugin and the resourceclaim controller against
//! an API server: claims from templates, allocation, reservation, binding, FailedScheduling
//! events on the pod, and release when pods go. It polls (a few lists every `poll_interval`), which
//! keeps it simple and reacts well within a second on the emulator.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{
    Binding, Event, EventSource, Node, ObjectReference, Pod, PodExtendedResourceClaimStatus,
    PodResourceClaimStatus,
};
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimConsumerReference, ResourceClaimTemplate,
    ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::claims::{
    claim_from_template, extended_resource_claim, is_allocated, is_extended_resource_claim,
    owned_by, owner_pod_uid, pod_claim_sources, ClaimSource,
};
use crate::placement::{candidate_nodes, claim_key, excluded_nodes, place};

/// Component name on events and in binding, like the real scheduler's.
const COMPONENT: &str = "default-scheduler";
/// Finalizer kube-scheduler puts on the claims it allocates; the resourceclaim controller
/// removes it after deallocating.
pub const DELETE_PROTECTION_FINALIZER: &str = "resource.kubernetes.io/delete-protection";
/// Upstream's limit on `status.reservedFor`.
const MAX_RESERVED_FOR: usize = 256;

#[derive(Debug, Clone)]
pub struct Options {
    /// How often the API server is listed.
    pub poll_interval: Duration,
    /// Pods naming another `spec.schedulerName` are left alone.
    pub scheduler_name: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            poll_interval: Duration::from_millis(150),
            scheduler_name: COMPONENT.to_string(),
        }
    }
}

/// A running loop; `stop` ends it after the current pass.
pub struct SchedulerHandle {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl SchedulerHandle {
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.task.await.context("scheduler task panicked")?
    }
}

/// Start the loop on the current tokio runtime.
pub fn spawn(client: Client, options: Options) -> SchedulerHandle {
    let (stop, stopped) = watch::channel(false);
    let task = tokio::spawn(run_until(client, options, stopped));
    SchedulerHandle { stop, task }
}

/// Run the loop until the task is dropped or aborted. A failed pass (API server away, a
/// conflict) is logged and retried on the next one.
pub async fn run(client: Client, options: Options) -> anyhow::Result<()> {
    let (_keep, stopped) = watch::channel(false);
    run_until(client, options, stopped).await
}

async fn run_until(
    client: Client,
    options: Options,
    mut stopped: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut scheduler = Scheduler {
        client,
        options,
        posted: HashMap::new(),
    };
    info!("scheduler stand-in started");
    loop {
        if *stopped.borrow() {
            return Ok(());
        }
        if let Err(err) = scheduler.pass().await {
            debug!("scheduler pass failed, retrying: {err:#}");
        }
        tokio::select! {
            _ = tokio::time::sleep(scheduler.options.poll_interval) => {}
            _ = stopped.changed() => {}
        }
    }
}

struct Scheduler {
    client: Client,
    options: Options,
    /// Last FailedScheduling message posted per object uid, so a pending pod does not get a
    /// new event every pass.
    posted: HashMap<String, String>,
}

/// Everything one pass works from.
struct World {
    pods: Vec<Pod>,
    claims: Vec<ResourceClaim>,
    nodes: Vec<Node>,
    classes: Vec<DeviceClass>,
    slices: Vec<ResourceSlice>,
}

fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn name_of(meta: &ObjectMeta) -> String {
    meta.name.clone().unwrap_or_default()
}

fn namespace_of(meta: &ObjectMeta) -> String {
    meta.namespace.clone().unwrap_or_default()
}

impl Scheduler {
    async fn pass(&mut self) -> anyhow::Result<()> {
        let lp = ListParams::default();
        let c = &self.client;
        let mut world = World {
            pods: Api::<Pod>::all(c.clone()).list(&lp).await?.items,
            claims: Api::<ResourceClaim>::all(c.clone()).list(&lp).await?.items,
            nodes: Api::<Node>::all(c.clone()).list(&lp).await?.items,
            classes: Api::<DeviceClass>::all(c.clone()).list(&lp).await?.items,
            slices: Api::<ResourceSlice>::all(c.clone()).list(&lp).await?.items,
        };
        self.release(&mut world).await;
        let mut waiting: Vec<Pod> = world
            .pods
            .iter()
            .filter(|p| self.wants_scheduling(p))
            .cloned()
            .collect();
        waiting.sort_by(|a, b| {
            (&a.metadata.creation_timestamp, &a.metadata.name)
                .cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
        });
        for pod in waiting {
            if let Err(err) = self.schedule(&pod, &mut world).await {
                warn!(
                    pod = %format!("{}/{}", namespace_of(&pod.metadata), name_of(&pod.metadata)),
                    "scheduling attempt failed, retrying: {err:#}"
                );
            }
        }
        Ok(())
    }

    fn wants_scheduling(&self, pod: &Pod) -> bool {
        let Some(spec) = &pod.spec else { return false };
        spec.node_name.as_deref().unwrap_or_default().is_empty()
            && pod.metadata.deletion_timestamp.is_none()
            && !is_terminal(pod)
            && spec.scheduler_name.as_deref().unwrap_or(COMPONENT) == self.options.scheduler_name
    }

    /// Drop reservations of pods that are gone or done; deallocate claims this scheduler
    /// allocated (they carry the delete-protection finalizer) once nobody uses them, then
    /// release the finalizer; delete claims generated for pods that are gone or done.
    async fn release(&mut self, world: &mut World) {
        let live: HashMap<&str, &Pod> = world
            .pods
            .iter()
            .filter(|p| !is_terminal(p))
            .filter_map(|p| p.metadata.uid.as_deref().map(|uid| (uid, p)))
            .collect();
        // Claims a pod still waiting for scheduling refers to keep their allocation.
        let wanted: HashSet<(String, String)> = world
            .pods
            .iter()
            .filter(|p| self.wants_scheduling(p))
            .flat_map(|p| {
                let ns = namespace_of(&p.metadata);
                let sources = pod_claim_sources(p, &world.claims).unwrap_or_default();
                sources
                    .into_iter()
                    .filter_map(move |(_, source)| match source {
                        ClaimSource::Named(name) => Some((ns.clone(), name)),
                        ClaimSource::Template { existing, .. } => existing.map(|n| (ns.clone(), n)),
                    })
            })
            .collect();
        let mut deleted = Vec::new();
        for claim in world.claims.iter_mut() {
            let key = (namespace_of(&claim.metadata), name_of(&claim.metadata));
            let label = format!("{}/{}", key.0, key.1);
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &key.0);
            let reserved = claim
                .status
                .as_ref()
                .and_then(|s| s.reserved_for.clone())
                .unwrap_or_default();
            let keep: Vec<ResourceClaimConsumerReference> = reserved
                .iter()
                .filter(|r| r.resource != "pods" || live.contains_key(r.uid.as_str()))
                .cloned()
                .collect();
            let deleting = claim.metadata.deletion_timestamp.is_some();
            let owner_gone = owner_pod_uid(claim).is_some_and(|uid| !live.contains_key(uid));
            let protected = has_finalizer(claim);
            let allocated = is_allocated(claim);
            let deallocate = keep.is_empty()
                && protected
                && allocated
                && (deleting || owner_gone || !wanted.contains(&key));
            if keep.len() != reserved.len() || deallocate {
                let mut updated = claim.clone();
                let status = updated.status.get_or_insert_with(Default::default);
                status.reserved_for = (!keep.is_empty()).then_some(keep.clone());
                if deallocate {
                    status.allocation = None;
                    status.devices = None;
                }
                match api
                    .replace_status(&key.1, &PostParams::default(), &updated)
                    .await
                {
                    Ok(written) => {
                        if deallocate {
                            info!(claim = %label, "deallocated a claim nobody uses");
                        }
                        *claim = written;
                    }
                    Err(err) => {
                        debug!("releasing claim {label}: {err}");
                        continue;
                    }
                }
            }
            let allocated = is_allocated(claim);
            if protected && !allocated && keep.is_empty() {
                let rest: Vec<String> = claim
                    .metadata
                    .finalizers
                    .iter()
                    .flatten()
                    .filter(|f| f.as_str() != DELETE_PROTECTION_FINALIZER)
                    .cloned()
                    .collect();
                let patch = serde_json::json!({"metadata": {
                    "finalizers": rest,
                    "resourceVersion": claim.metadata.resource_version,
                }});
                match api
                    .patch(&key.1, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(written) => *claim = written,
                    Err(err) => {
                        debug!("releasing the finalizer of claim {label}: {err}");
                        continue;
                    }
                }
            }
            if owner_gone && keep.is_empty() && !deleting {
                match api.delete(&key.1, &DeleteParams::default()).await {
                    Ok(_) => {
                        info!(claim = %label, "deleted the claim of a finished pod");
                        deleted.push(key);
                    }
                    Err(err) => debug!("deleting claim {label}: {err}"),
                }
            }
        }
        world
            .claims
            .retain(|c| !deleted.contains(&(namespace_of(&c.metadata), name_of(&c.metadata))));
    }

    async fn schedule(&mut self, pod: &Pod, world: &mut World) -> anyhow::Result<()> {
        let ns = namespace_of(&pod.metadata);
        let pod_name = name_of(&pod.metadata);
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let claims_api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &ns);
        let pods_api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);

        let sources = match pod_claim_sources(pod, &world.claims) {
            Ok(sources) => sources,
            Err(err) => {
                self.post_pod_event(pod, &err.to_string()).await;
                return Ok(());
            }
        };
        let mut statuses = pod
            .status
            .as_ref()
            .and_then(|s| s.resource_claim_statuses.clone())
            .unwrap_or_default();
        let statuses_before = statuses.clone();
        let mut names = Vec::new();
        for (entry, source) in sources {
            let name = match source {
                ClaimSource::Named(name) => name,
                ClaimSource::Template {
                    existing: Some(name),
                    ..
                } => name,
                ClaimSource::Template {
                    template,
                    existing: None,
                } => {
                    let templates: Api<ResourceClaimTemplate> =
                        Api::namespaced(self.client.clone(), &ns);
                    let Some(template) = templates.get_opt(&template).await? else {
                        let message = format!(
                            "resourceclaimtemplate.resource.k8s.io \"{template}\" not found"
                        );
                        self.post_pod_event(pod, &message).await;
                        return Ok(());
                    };
                    let created = claims_api
                        .create(
                            &PostParams::default(),
                            &claim_from_template(pod, &entry, &template),
                        )
                        .await
                        .context("creating a claim from its template")?;
                    info!(claim = %format!("{ns}/{}", name_of(&created.metadata)), pod = %pod_name, "created a claim from template");
                    let name = name_of(&created.metadata);
                    world.claims.push(created);
                    name
                }
            };
            if entry.resource_claim_template_name.is_some()
                && !statuses.iter().any(|s| s.name == entry.name)
            {
                statuses.push(PodResourceClaimStatus {
                    name: entry.name.clone(),
                    resource_claim_name: Some(name.clone()),
                });
            }
            names.push(name);
        }
        if statuses != statuses_before {
            let patch = serde_json::json!({"status": {"resourceClaimStatuses": statuses}});
            pods_api
                .patch_status(&pod_name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .context("recording the pod's generated claims")?;
        }

        let mut pod_claims: Vec<ResourceClaim> = Vec::new();
        for name in &names {
            let found = world.claims.iter().find(|c| {
                namespace_of(&c.metadata) == ns && c.metadata.name.as_deref() == Some(name)
            });
            match found {
                Some(claim) if claim.metadata.deletion_timestamp.is_some() => {
                    let message = format!("resourceclaim {ns}/{name} is being deleted");
                    self.post_pod_event(pod, &message).await;
                    return Ok(());
                }
                Some(claim) => pod_claims.push(claim.clone()),
                None => {
                    let message = format!("resourceclaim.resource.k8s.io \"{name}\" not found");
                    self.post_pod_event(pod, &message).await;
                    return Ok(());
                }
            }
        }

        // The claim for extended resources: the one made earlier, or a new one in memory
        // that is only created once a node is found.
        let mut extended_mappings = None;
        let mut extended_name = None;
        match extended_resource_claim(pod, &world.classes) {
            Ok(Some((mut claim, mappings))) => {
                extended_mappings = Some(mappings);
                match world
                    .claims
                    .iter()
                    .find(|c| owned_by(c, &pod_uid) && is_extended_resource_claim(c))
                {
                    Some(existing) => {
                        extended_name = existing.metadata.name.clone();
                        pod_claims.push(existing.clone());
                    }
                    None => {
                        claim.metadata.name = Some(format!("{pod_name}-extended-resources"));
                        pod_claims.push(claim);
                    }
                }
            }
            Ok(None) => {}
            Err(err) => {
                self.post_pod_event(pod, &err.to_string()).await;
                return Ok(());
            }
        }

        let (bound, pending): (Vec<&ResourceClaim>, Vec<&ResourceClaim>) =
            pod_claims.iter().partition(|c| is_allocated(c));
        let allocated: Vec<ResourceClaim> = world
            .claims
            .iter()
            .filter(|c| is_allocated(c))
            .cloned()
            .collect();
        let nodes = candidate_nodes(pod, &world.nodes);
        let placement = match place(
            &pending,
            &bound,
            &nodes,
            &world.classes,
            &world.slices,
            &allocated,
        ) {
            Ok(placement) => placement,
            // Like kube-scheduler: the event goes on the pod only; the claims stay as they were.
            Err(mut no_fit) => {
                no_fit.excluded = excluded_nodes(pod, &world.nodes);
                self.post_pod_event(pod, &no_fit.to_string()).await;
                return Ok(());
            }
        };

        let consumer = ResourceClaimConsumerReference {
            api_group: None,
            resource: "pods".to_string(),
            name: pod_name.clone(),
            uid: pod_uid.clone(),
        };
        let mut allocations = placement.allocations.into_iter();
        for claim in &pod_claims {
            let mut updated = claim.clone();
            if claim.metadata.uid.is_none() {
                // The extended-resource claim exists only in memory so far.
                let mut fresh = claim.clone();
                fresh.metadata.name = None;
                updated = claims_api
                    .create(&PostParams::default(), &fresh)
                    .await
                    .context("creating the extended-resource claim")?;
                extended_name = updated.metadata.name.clone();
                world.claims.push(updated.clone());
            }
            let needs_allocation = !is_allocated(&updated);
            if needs_allocation && !has_finalizer(&updated) {
                // Like kube-scheduler: protect the claim from deletion while allocated.
                let mut finalizers = updated.metadata.finalizers.clone().unwrap_or_default();
                finalizers.push(DELETE_PROTECTION_FINALIZER.to_string());
                let patch = serde_json::json!({"metadata": {
                    "finalizers": finalizers,
                    "resourceVersion": updated.metadata.resource_version,
                }});
                updated = claims_api
                    .patch(
                        &name_of(&updated.metadata),
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                    .context("adding the delete-protection finalizer")?;
            }
            let status = updated.status.get_or_insert_with(Default::default);
            if status.allocation.is_none() {
                let mut allocation = allocations
                    .next()
                    .context("placement returned fewer allocations than pending claims")?;
                allocation.allocation_timestamp = Some(Time(Timestamp::now()));
                status.allocation = Some(allocation);
            }
            let reserved = status.reserved_for.get_or_insert_with(Vec::new);
            if reserved.iter().any(|r| r.uid == pod_uid) {
                continue;
            }
            if reserved.len() >= MAX_RESERVED_FOR {
                let message = format!(
                    "resourceclaim {} is in use by {MAX_RESERVED_FOR} consumers already",
                    claim_key(claim)
                );
                self.post_pod_event(pod, &message).await;
                return Ok(());
            }
            reserved.push(consumer.clone());
            let name = name_of(&updated.metadata);
            let written = claims_api
                .replace_status(&name, &PostParams::default(), &updated)
                .await
                .with_context(|| format!("writing the allocation of claim {ns}/{name}"))?;
            if let Some(slot) = world
                .claims
                .iter_mut()
                .find(|c| c.metadata.uid == written.metadata.uid)
            {
                *slot = written;
            }
        }
        if let (Some(mappings), Some(name)) = (extended_mappings, extended_name) {
            let status = PodExtendedResourceClaimStatus {
                request_mappings: mappings,
                resource_claim_name: name,
            };
            let recorded = pod
                .status
                .as_ref()
                .and_then(|s| s.extended_resource_claim_status.as_ref());
            if recorded != Some(&status) {
                let patch = serde_json::json!({"status": {"extendedResourceClaimStatus": status}});
                pods_api
                    .patch_status(&pod_name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .context("recording the pod's extended-resource claim")?;
            }
        }
        self.bind(&pods_api, pod, &placement.node).await?;
        self.finish(pod, &placement.node).await;
        Ok(())
    }

    /// After binding: forget the pod's failure messages and say where it went.
    async fn finish(&mut self, pod: &Pod, node: &str) {
        let ns = namespace_of(&pod.metadata);
        let pod_name = name_of(&pod.metadata);
        if let Some(uid) = &pod.metadata.uid {
            self.posted.remove(uid);
        }
        let message = format!("Successfully assigned {ns}/{pod_name} to {node}");
        self.create_event(&pod_reference(pod), "Normal", "Scheduled", &message)
            .await;
        info!(pod = %format!("{ns}/{pod_name}"), node = %node, "bound pod");
    }

    /// POST pods/<name>/binding as kube-scheduler does; an API server without the binding
    /// subresource gets spec.nodeName patched instead.
    async fn bind(&self, pods: &Api<Pod>, pod: &Pod, node: &str) -> anyhow::Result<()> {
        let name = name_of(&pod.metadata);
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: pod.metadata.namespace.clone(),
                uid: pod.metadata.uid.clone(),
                ..Default::default()
            },
            target: ObjectReference {
                api_version: Some("v1".to_string()),
                kind: Some("Node".to_string()),
                name: Some(node.to_string()),
                ..Default::default()
            },
        };
        let posted: Result<serde_json::Value, _> = pods
            .create_subresource("binding", &name, &PostParams::default(), &binding)
            .await;
        if let Err(err) = posted {
            debug!("binding subresource failed ({err}); patching spec.nodeName");
            let patch = serde_json::json!({"spec": {"nodeName": node}});
            pods.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .with_context(|| format!("binding pod {name} to {node}"))?;
        }
        Ok(())
    }

    async fn post_pod_event(&mut self, pod: &Pod, message: &str) {
        let reference = pod_reference(pod);
        self.post_event(&reference, message).await;
    }

    /// A Warning FailedScheduling event, once per distinct message per object.
    async fn post_event(&mut self, object: &ObjectReference, message: &str) {
        let uid = object.uid.clone().unwrap_or_default();
        if self.posted.get(&uid).map(String::as_str) == Some(message) {
            return;
        }
        if self
            .create_event(object, "Warning", "FailedScheduling", message)
            .await
        {
            self.posted.insert(uid, message.to_string());
        }
    }

    async fn create_event(
        &self,
        object: &ObjectReference,
        type_: &str,
        reason: &str,
        message: &str,
    ) -> bool {
        let now = Timestamp::now();
        let namespace = object
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(format!(
                    "{}.{:x}",
                    object.name.as_deref().unwrap_or("object"),
                    now.as_nanosecond()
                )),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            involved_object: object.clone(),
            reason: Some(reason.to_string()),
            message: Some(message.to_string()),
            type_: Some(type_.to_string()),
            source: Some(EventSource {
                component: Some(COMPONENT.to_string()),
                host: None,
            }),
            reporting_component: Some(COMPONENT.to_string()),
            reporting_instance: Some("gpupool-scheduler".to_string()),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            count: Some(1),
            action: Some("Scheduling".to_string()),
            ..Default::default()
        };
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        match events.create(&PostParams::default(), &event).await {
            Ok(_) => {
                info!(
                    object = %format!("{}/{}", namespace, object.name.as_deref().unwrap_or_default()),
                    "{reason}: {message}"
                );
                true
            }
            Err(err) => {
                debug!("posting event: {err}");
                false
            }
        }
    }
}

fn has_finalizer(claim: &ResourceClaim) -> bool {
    claim
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == DELETE_PROTECTION_FINALIZER)
}

fn pod_reference(pod: &Pod) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Pod".to_string()),
        name: pod.metadata.name.clone(),
        namespace: pod.metadata.namespace.clone(),
        uid: pod.metadata.uid.clone(),
        resource_version: pod.metadata.resource_version.clone(),
        field_path: None,
    }
}
