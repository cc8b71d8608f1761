//! What arrived, checked against the rows that should have, for either broker (arrivals are
//! message ids, `ce_id`s on Kafka): rows lost, ids delivered twice, ids that are not rows, and
//! first arrivals of an aggregate out of `seq` order.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;

use uuid::Uuid;

use crate::RowState;

/// Deliveries checked against the rows that should have been delivered.
#[derive(Debug, Default)]
pub struct Analysis {
    /// Rows never delivered.
    pub lost: Vec<Uuid>,
    /// First arrivals of an aggregate out of `seq` order.
    pub reordered: Vec<String>,
    /// Deliveries beyond the first of each id.
    pub duplicates: usize,
    /// Deliveries per id.
    pub counts: HashMap<Uuid, usize>,
    /// Deliveries whose id is not one of the expected rows.
    pub foreign: Vec<String>,
}

/// `arrivals`: message ids in arrival order; `expected`: the rows that must arrive.
pub fn analyse<'a>(expected: &[RowState], arrivals: impl IntoIterator<Item = &'a str>) -> Analysis {
    let by_id: HashMap<Uuid, &RowState> = expected.iter().map(|r| (r.id, r)).collect();
    let mut out = Analysis::default();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    for m in arrivals {
        let Some(row) = m.parse::<Uuid>().ok().and_then(|id| by_id.get(&id)) else {
            out.foreign.push(m.to_owned());
            continue;
        };
        let n = out.counts.entry(row.id).or_insert(0);
        *n += 1;
        if *n > 1 {
            out.duplicates += 1;
            continue;
        }
        if let Some(agg) = row.aggregate() {
            match last_seq.get(&agg) {
                Some(&prev) if prev > row.seq => out
                    .reordered
                    .push(format!("{agg}: seq {} arrived after {prev}", row.seq)),
                _ => {
                    last_seq.insert(agg, row.seq);
                }
            }
        }
    }
    out.lost = expected
        .iter()
        .filter(|r| !out.counts.contains_key(&r.id))
        .map(|r| r.id)
        .collect();
    out
}

impl Analysis {
    /// Asserts that nothing was lost, reordered (per aggregate, first arrivals) or foreign.
    pub fn assert_complete(&self, what: &str) {
        assert_none(&format!("{what}: rows never arrived"), &self.lost);
        assert_none(
            &format!("{what}: first arrivals out of seq order"),
            &self.reordered,
        );
        assert_none(
            &format!("{what}: deliveries of ids that are not rows"),
            &self.foreign,
        );
    }

    /// [`Analysis::assert_complete`], and no id delivered twice.
    pub fn assert_exactly_once(&self, what: &str) {
        self.assert_complete(what);
        let twice: Vec<_> = self.counts.iter().filter(|(_, n)| **n > 1).collect();
        assert_none(&format!("{what}: ids delivered more than once"), &twice);
    }

    /// The same analysis with the order not judged (for `ordering = "none"`).
    pub fn ignoring_order(mut self) -> Self {
        self.reordered.clear();
        self
    }

    /// Ids delivered more than once.
    pub fn duplicated_ids(&self) -> HashSet<Uuid> {
        self.counts
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(id, _)| *id)
            .collect()
    }
}

/// Asserts that `problems` is empty; the message counts them and shows the first ten.
pub fn assert_none<T: Debug>(what: &str, problems: &[T]) {
    assert!(
        problems.is_empty(),
        "{} {what}, first 10: {:#?}",
        problems.len(),
        &problems[..problems.len().min(10)]
    );
}

/// The problems of rows that must each be sent on their first attempt and released.
pub fn not_sent_once(rows: &[RowState]) -> Vec<String> {
    rows.iter().filter_map(RowState::not_sent_once).collect()
}

/// The problems of rows that must each be sent on their first attempt, with a `sent_at`, no
/// lock and no error.
pub fn not_sent_cleanly(rows: &[RowState]) -> Vec<String> {
    rows.iter().filter_map(RowState::not_sent_cleanly).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row sent on its first attempt, cleanly.
    fn row(seq: i64, aggregate: Option<&str>) -> RowState {
        RowState {
            id: Uuid::new_v4(),
            seq,
            aggregate_type: "t".into(),
            aggregate_id: aggregate.map(str::to_owned),
            status: "sent".into(),
            attempts: 1,
            sent_at: Some(chrono::Utc::now()),
            ..RowState::default()
        }
    }

    /// Each kind of wrong delivery is found, and makes the assertion fail.
    #[test]
    fn analyse_finds_lost_duplicated_foreign_and_reordered_deliveries() {
        let rows = [row(1, Some("a")), row(2, Some("a")), row(3, None)];
        let id = |i: usize| rows[i].id.to_string();
        let ok = analyse(&rows, [id(0), id(1), id(2)].iter().map(String::as_str));
        ok.assert_exactly_once("in order");
        let bad = [
            vec![id(0), id(1)],                    // lost
            vec![id(0), id(1), id(2), id(2)],      // duplicated
            vec![id(0), id(1), id(2), "x".into()], // foreign
            vec![id(1), id(0), id(2)],             // reordered
        ];
        for arrivals in bad {
            let a = analyse(&rows, arrivals.iter().map(String::as_str));
            let failed = std::panic::catch_unwind(|| a.assert_exactly_once("case"));
            assert!(failed.is_err(), "{arrivals:?} passed");
        }
        let reordered = analyse(&rows, [id(1), id(0), id(2)].iter().map(String::as_str));
        reordered
            .ignoring_order()
            .assert_exactly_once("order not judged");
        let mut unsent = row(4, None);
        unsent.attempts = 2;
        assert_eq!(not_sent_once(&[unsent.clone()]).len(), 1);
        unsent.attempts = 1;
        unsent.last_error = Some("x".into());
        assert!(not_sent_once(&[unsent.clone()]).is_empty());
        assert_eq!(not_sent_cleanly(&[unsent]).len(), 1);
    }
}
