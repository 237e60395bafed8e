//! Fixtures shared by the unit tests of the pure modules.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// `seconds` after the Unix epoch.
pub(crate) fn at(seconds: i64) -> Time {
    Time(Timestamp::from_second(seconds).unwrap())
}

/// The condition of a type; panics when there is none.
pub(crate) fn condition<'a>(conditions: &'a [Condition], type_: &str) -> &'a Condition {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {conditions:?}"))
}
