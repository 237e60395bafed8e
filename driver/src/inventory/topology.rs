//! NVLink domains: which cards of the node talk to each other over NVLink, directly (bridges) or
//! through one NVSwitch fabric (HGX boards). Pure: NVML's link calls (or a fake layout) give each
//! card's link peers, [`nvlink_domains`] groups the cards.
//!
//! There is no standard Kubernetes attribute for NVLink; the driver publishes the domain as
//! `gpupool.dev/nvlinkDomain` so that a claim can ask for N cards with `matchAttribute` on it.

use std::collections::BTreeMap;

/// What one active NVLink of a card reaches (`nvmlDeviceGetNvLinkRemoteDeviceType` and
/// `nvmlDeviceGetNvLinkRemotePciInfo_v2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkPeer {
    /// Another GPU, by PCI bus id.
    Gpu(String),
    /// An NVSwitch, by PCI bus id: every card reaching a switch of one fabric shares its domain.
    Switch(String),
    /// An IBM NPU or something NVML does not name: not a path to another GPU.
    Other,
}

/// A card's active NVLinks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLinks {
    /// The card's PCI bus id, in the form the inventory uses.
    pub bus_id: String,
    pub peers: Vec<LinkPeer>,
}

/// The NVLink domain of each card that shares one with another card, by bus id: cards connected
/// through GPU-GPU links or common switches get the same value, `nvlink-<lowest bus id in the
/// domain>` (stable across restarts, unique on the node). A card alone has none.
pub fn nvlink_domains(cards: &[GpuLinks]) -> BTreeMap<String, String> {
    // Union-find over nodes: the cards and the switches they reach.
    let mut parent: BTreeMap<String, String> = BTreeMap::new();
    fn root(parent: &mut BTreeMap<String, String>, node: &str) -> String {
        let mut at = node.to_string();
        while let Some(up) = parent.get(&at).filter(|up| **up != at).cloned() {
            at = up;
        }
        at
    }
    fn join(parent: &mut BTreeMap<String, String>, a: &str, b: &str) {
        let (ra, rb) = (root(parent, a), root(parent, b));
        if ra != rb {
            // The smaller name becomes the root, so that the result does not depend on order.
            let (low, high) = if ra < rb { (ra, rb) } else { (rb, ra) };
            parent.insert(high, low);
        }
    }
    let gpu_node = |bus: &str| format!("gpu/{bus}");
    let known: Vec<&str> = cards.iter().map(|c| c.bus_id.as_str()).collect();
    for card in cards {
        parent
            .entry(gpu_node(&card.bus_id))
            .or_insert_with(|| gpu_node(&card.bus_id));
    }
    for card in cards {
        for peer in &card.peers {
            let other = match peer {
                // A link to a card NVML did not list (another partition's) joins nothing here.
                LinkPeer::Gpu(bus) if known.contains(&bus.as_str()) => gpu_node(bus),
                LinkPeer::Switch(bus) => format!("switch/{bus}"),
                LinkPeer::Gpu(_) | LinkPeer::Other => continue,
            };
            parent.entry(other.clone()).or_insert_with(|| other.clone());
            join(&mut parent, &gpu_node(&card.bus_id), &other);
        }
    }
    let mut members: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for card in cards {
        let r = root(&mut parent, &gpu_node(&card.bus_id));
        members.entry(r).or_default().push(&card.bus_id);
    }
    let mut domains = BTreeMap::new();
    for cards in members.values().filter(|m| m.len() > 1) {
        let lowest = cards.iter().min().expect("not empty");
        for bus in cards {
            domains.insert(bus.to_string(), format!("nvlink-{lowest}"));
        }
    }
    domains
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(bus: &str, peers: Vec<LinkPeer>) -> GpuLinks {
        GpuLinks {
            bus_id: bus.to_string(),
            peers,
        }
    }

    #[test]
    fn cards_on_one_switch_fabric_share_a_domain_whatever_the_order() {
        let switch = |s: &str| LinkPeer::Switch(s.to_string());
        let cards = vec![
            card("0000:b0:00.0", vec![switch("sw-1"), switch("sw-2")]),
            card("0000:10:00.0", vec![switch("sw-2")]),
            card("0000:50:00.0", vec![switch("sw-1")]),
            card("0000:90:00.0", vec![]),
        ];
        let domains = nvlink_domains(&cards);
        assert_eq!(domains.len(), 3);
        assert!(domains.values().all(|d| d == "nvlink-0000:10:00.0"));
        assert!(!domains.contains_key("0000:90:00.0"));
        let mut reversed = cards.clone();
        reversed.reverse();
        assert_eq!(nvlink_domains(&reversed), domains);
    }

    #[test]
    fn bridged_pairs_are_separate_domains_and_unknown_peers_join_nothing() {
        let gpu = |b: &str| LinkPeer::Gpu(b.to_string());
        let cards = vec![
            card("0000:01:00.0", vec![gpu("0000:02:00.0"), LinkPeer::Other]),
            card("0000:02:00.0", vec![gpu("0000:01:00.0")]),
            card("0000:03:00.0", vec![gpu("0000:04:00.0")]),
            card("0000:04:00.0", vec![gpu("0000:03:00.0")]),
            card("0000:05:00.0", vec![gpu("0000:99:00.0")]),
        ];
        let domains = nvlink_domains(&cards);
        assert_eq!(domains["0000:01:00.0"], "nvlink-0000:01:00.0");
        assert_eq!(domains["0000:02:00.0"], "nvlink-0000:01:00.0");
        assert_eq!(domains["0000:04:00.0"], "nvlink-0000:03:00.0");
        assert!(!domains.contains_key("0000:05:00.0"));
    }
}
