//! Status conditions with Kubernetes semantics: `lastTransitionTime` moves only when a condition's
//! status flips, so a controller that recomputes everything on each pass does not rewrite history.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub const READY: &str = "Ready";
pub const INVALID: &str = "Invalid";
pub const CONFLICT: &str = "Conflict";
pub const NO_MATCHING_DEVICES: &str = "NoMatchingDevices";

/// A condition as the pure logic decides it, before times and generations are attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub type_: &'static str,
    pub status: bool,
    pub reason: String,
    pub message: String,
}

impl Verdict {
    pub fn new(
        type_: &'static str,
        status: bool,
        reason: &str,
        message: impl Into<String>,
    ) -> Self {
        Verdict {
            type_,
            status,
            reason: reason.to_string(),
            message: message.into(),
        }
    }
}

/// The conditions to write: `verdicts` in order, each keeping the `lastTransitionTime` of the existing
/// condition of its type when the status is the same, else stamped `now`.
pub fn merge(
    existing: &[Condition],
    verdicts: &[Verdict],
    observed_generation: Option<i64>,
    now: &Time,
) -> Vec<Condition> {
    verdicts
        .iter()
        .map(|verdict| {
            let status = if verdict.status { "True" } else { "False" };
            let last_transition_time = existing
                .iter()
                .find(|c| c.type_ == verdict.type_ && c.status == status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            Condition {
                type_: verdict.type_.to_string(),
                status: status.to_string(),
                reason: verdict.reason.clone(),
                message: verdict.message.clone(),
                observed_generation,
                last_transition_time,
            }
        })
        .collect()
}

/// The condition of a type, if present and True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::at;

    #[test]
    fn unchanged_status_keeps_its_transition_time_even_if_the_message_changes() {
        let first = merge(
            &[],
            &[Verdict::new(READY, true, "Ready", "2 devices")],
            Some(1),
            &at(100),
        );
        let second = merge(
            &first,
            &[Verdict::new(READY, true, "Ready", "3 devices")],
            Some(2),
            &at(200),
        );
        assert_eq!(second[0].last_transition_time, at(100));
        assert_eq!(second[0].message, "3 devices");
        assert_eq!(second[0].observed_generation, Some(2));
    }

    #[test]
    fn flipped_status_gets_a_new_transition_time() {
        let first = merge(
            &[],
            &[Verdict::new(READY, true, "Ready", "")],
            None,
            &at(100),
        );
        let second = merge(
            &first,
            &[Verdict::new(READY, false, "Invalid", "weight 0")],
            None,
            &at(200),
        );
        assert_eq!(second[0].status, "False");
        assert_eq!(second[0].last_transition_time, at(200));
        assert!(!is_true(&second, READY));
    }
}
