//! The node guard (pure): a MIG device is never prepared on a card that a live claim holds whole
//! or in fractions, a card never while a live claim holds one of its MIG devices, and two MIG
//! devices never on one memory slice. kube-scheduler >= 1.36.2 keeps them apart through the
//! counters; kube-scheduler 1.36.0 and 1.36.1, Volcano (which pins 1.36.1) and KAI-scheduler
//! up to v0.17.0 do not (docs/architecture.md, "The node guard"), and this check is the only
//! protection under them: it turns a double booking into a clear per-claim error instead of a
//! container that finds its card in the wrong mode.
//!
//! It also keeps MPS shares (`compute: Mps`) and other shares of a card apart: a card's shares are
//! all MPS clients of its daemon or none is, since a process outside the daemon time-slices beside
//! its clients and neither gets its share. No scheduler can see that (it is a config, not a
//! device), so this check is the only protection there.

use std::ops::Range;

use thiserror::Error;

/// What a device takes of its card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Use {
    /// `gpu-<i>`: the whole card or a fraction of it, an MPS share or not.
    Card { gpu: u32, mps: bool },
    /// A MIG device on these memory slices of card `gpu`.
    Mig { gpu: u32, slices: Range<u32> },
}

impl Use {
    fn gpu(&self) -> u32 {
        match self {
            Use::Card { gpu, .. } | Use::Mig { gpu, .. } => *gpu,
        }
    }
}

/// A device a claim holds (prepared, or being prepared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// `namespace/name` of the claim.
    pub claim: String,
    pub device: String,
    pub what: Use,
}

/// Why a claim's device cannot be prepared next to another.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{device} {conflict} {held_device} of claim {held_by}; {why}")]
pub struct Conflict {
    pub device: String,
    pub conflict: &'static str,
    pub held_device: String,
    pub held_by: String,
    pub why: &'static str,
}

const MIG_APART: &str = "MIG devices and whole cards or fractions never share a card. A scheduler \
     that counts partitionable devices (kube-scheduler >= 1.36.2) keeps them apart; the one that \
     allocated this claim did not";
const MPS_APART: &str = "a card's shares are all MPS shares (compute: Mps) or none: a process \
     outside the card's MPS daemon would time-slice beside its clients and neither would get its \
     share. No scheduler sees this setting: give MPS claims cards of their own (a DeviceClass \
     that selects them)";

/// Whether `wanted` (the devices of the claim being prepared) may be prepared beside `held`
/// (every other live claim's devices). A claim may hold several devices of one card only in
/// the ways the scheduler allows: fractions of a card, or MIG devices on distinct slices.
pub fn check(claim: &str, wanted: &[(String, Use)], held: &[Held]) -> Result<(), Conflict> {
    let own: Vec<Held> = wanted
        .iter()
        .map(|(device, what)| Held {
            claim: claim.to_string(),
            device: device.clone(),
            what: what.clone(),
        })
        .collect();
    for (i, (device, what)) in wanted.iter().enumerate() {
        // The claim's earlier devices count too: one claim may not hold a card and its MIG.
        for other in held.iter().chain(&own[..i]) {
            if other.what.gpu() != what.gpu() {
                continue;
            }
            let conflict = match (what, &other.what) {
                (Use::Card { mps: a, .. }, Use::Card { mps: b, .. }) if a == b => None,
                (Use::Card { mps: true, .. }, Use::Card { .. }) => Some((
                    "is an MPS share, and the card is shared without MPS as",
                    MPS_APART,
                )),
                (Use::Card { .. }, Use::Card { .. }) => Some((
                    "is a share without MPS, and the card is shared through MPS as",
                    MPS_APART,
                )),
                (Use::Mig { .. }, Use::Card { .. }) => Some((
                    "is a MIG partition of the card held whole or in fractions as",
                    MIG_APART,
                )),
                (Use::Card { .. }, Use::Mig { .. }) => Some((
                    "is the whole card, and its MIG partition is held as",
                    MIG_APART,
                )),
                (Use::Mig { slices: a, .. }, Use::Mig { slices: b, .. }) => (a.start < b.end
                    && b.start < a.end)
                    .then_some(("takes memory slices of the MIG device", MIG_APART)),
            };
            if let Some((conflict, why)) = conflict {
                return Err(Conflict {
                    device: device.clone(),
                    conflict,
                    held_device: other.device.clone(),
                    held_by: other.claim.clone(),
                    why,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(claim: &str, device: &str, what: Use) -> Held {
        Held {
            claim: claim.into(),
            device: device.into(),
            what,
        }
    }

    fn mig(gpu: u32, slices: Range<u32>) -> Use {
        Use::Mig { gpu, slices }
    }

    #[test]
    fn a_mig_device_is_refused_on_a_card_held_in_fractions_and_not_on_another_card() {
        let live = [held("ns/half", "gpu-0", Use::Card { gpu: 0, mps: false })];
        let err = check(
            "ns/small",
            &[("gpu-0-mig-1g-10gb-0".into(), mig(0, 0..1))],
            &live,
        )
        .unwrap_err();
        assert_eq!(err.held_by, "ns/half");
        let text = err.to_string();
        assert!(
            text.contains("gpu-0-mig-1g-10gb-0 is a MIG partition")
                && text.contains("gpu-0 of claim ns/half")
                && text.contains("1.36.2"),
            "{text}"
        );
        assert_eq!(
            check(
                "ns/small",
                &[("gpu-1-mig-1g-10gb-0".into(), mig(1, 0..1))],
                &live
            ),
            Ok(())
        );
    }

    #[test]
    fn a_card_is_refused_while_one_of_its_mig_devices_is_held() {
        let live = [held("ns/small", "gpu-2-mig-3g-40gb-4", mig(2, 4..8))];
        let err = check(
            "ns/whole",
            &[("gpu-2".into(), Use::Card { gpu: 2, mps: false })],
            &live,
        )
        .unwrap_err();
        assert!(err.to_string().contains("gpu-2 is the whole card"), "{err}");
        assert_eq!(
            check(
                "ns/whole",
                &[("gpu-1".into(), Use::Card { gpu: 1, mps: false })],
                &live
            ),
            Ok(())
        );
    }

    #[test]
    fn mig_devices_on_distinct_slices_share_a_card_and_overlapping_ones_do_not() {
        let live = [held("ns/a", "gpu-0-mig-2g-20gb-2", mig(0, 2..4))];
        assert_eq!(
            check(
                "ns/b",
                &[("gpu-0-mig-2g-20gb-4".into(), mig(0, 4..6))],
                &live
            ),
            Ok(())
        );
        let err = check(
            "ns/b",
            &[("gpu-0-mig-3g-40gb-0".into(), mig(0, 0..4))],
            &live,
        )
        .unwrap_err();
        assert!(err.to_string().contains("takes memory slices"), "{err}");
    }

    #[test]
    fn fractions_share_a_card_and_one_claim_cannot_hold_a_card_and_its_mig() {
        let live = [held("ns/a", "gpu-0", Use::Card { gpu: 0, mps: false })];
        assert_eq!(
            check(
                "ns/b",
                &[("gpu-0".into(), Use::Card { gpu: 0, mps: false })],
                &live
            ),
            Ok(())
        );
        let both = [
            ("gpu-1".to_string(), Use::Card { gpu: 1, mps: false }),
            ("gpu-1-mig-1g-10gb-0".to_string(), mig(1, 0..1)),
        ];
        let err = check("ns/c", &both, &[]).unwrap_err();
        assert_eq!(err.held_by, "ns/c");
    }

    #[test]
    fn mps_shares_and_other_shares_never_share_a_card() {
        let mps = |gpu| Use::Card { gpu, mps: true };
        let plain = |gpu| Use::Card { gpu, mps: false };
        let live = [held("ns/thirty", "gpu-0", mps(0))];
        assert_eq!(
            check("ns/seventy", &[("gpu-0".into(), mps(0))], &live),
            Ok(())
        );
        let err = check("ns/limited", &[("gpu-0".into(), plain(0))], &live).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("gpu-0 is a share without MPS, and the card is shared through MPS as gpu-0 of claim ns/thirty")
                && text.contains("compute: Mps"),
            "{text}"
        );
        let live = [held("ns/limited", "gpu-1", plain(1))];
        let err = check("ns/thirty", &[("gpu-1".into(), mps(1))], &live).unwrap_err();
        assert!(
            err.to_string().starts_with("gpu-1 is an MPS share"),
            "{err}"
        );
        assert_eq!(
            check("ns/thirty", &[("gpu-0".into(), mps(0))], &live),
            Ok(())
        );
        // MIG against an MPS share is a MIG conflict, as against any share.
        let live = [held("ns/thirty", "gpu-0", mps(0))];
        let err = check(
            "ns/small",
            &[("gpu-0-mig-1g-10gb-0".into(), mig(0, 0..1))],
            &live,
        )
        .unwrap_err();
        assert!(err.to_string().contains("1.36.2"), "{err}");
    }
}
