//! The SQL predicates several statements share, each rendered for a table alias (`""` for
//! none), so that every statement spells them alike, and like the partial indexes of `sql/`
//! that the planner must match them with; and the one way to write a string literal.

/// `last_error` prefix of rows reclaimed from a relay that died while holding them (suspects
/// of the crash, claimed one at a time).
pub(super) const SUSPECT: &str = "lease expired:";

/// `text` as an SQL string literal, `'` doubled (the relay quotes only names it validated and
/// texts it made itself this way).
pub(super) fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The index named by the parameter `index` is a valid index of the table named by the
/// parameter `table` (both resolved with `to_regclass`: a missing one is no index).
pub(super) fn valid_index(index: &str, table: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass({index}) \
         AND indrelid = to_regclass({table}) AND indisvalid)"
    )
}

/// `alias.`, or nothing for no alias.
fn qualifier(alias: &str) -> String {
    if alias.is_empty() {
        String::new()
    } else {
        format!("{alias}.")
    }
}

/// A row waiting to go out or dead: `pending` or `failed`. Spelled as the predicate of the
/// `<table>_waiting_idx` partial index (schema version 6). With the `processing` rows (the
/// small `<table>_processing_idx`) these are the open rows, the ones that hold back the later
/// rows of their aggregate; `sent` and `expired` rows hold back nothing.
pub(super) fn waiting(alias: &str) -> String {
    let a = qualifier(alias);
    format!("{a}status IN ('pending', 'failed')")
}

/// A row that may hold back the rest of its aggregate for longer than a claim: a dead letter,
/// or a pending row whose `available_at` was moved past its `created_at` (by a failed
/// attempt's backoff, a reclaim, an operator's retry, or the application). Spelled as the
/// predicate of the `<table>_blocker_idx` partial index (schema version 7). A row inserted
/// with both columns left to their defaults has them equal and is not one, so neither the
/// application's insert nor the relay's claim or mark sent writes an entry there.
pub(super) fn blocker(alias: &str) -> String {
    let a = qualifier(alias);
    format!("{a}status = 'failed' OR ({a}status = 'pending' AND {a}available_at > {a}created_at)")
}

/// A pending row an ordinary claim may take now, as far as the row itself goes: due
/// (`available_at` passed), not a suspect, not past its deadline.
pub(super) fn ready(alias: &str) -> String {
    let a = qualifier(alias);
    format!(
        "{a}available_at <= now() AND {} AND {}",
        not_suspect(alias),
        not_due(alias)
    )
}

/// Not a row reclaimed from a dead relay ([`SUSPECT`]): ordinary claims never take those.
pub(super) fn not_suspect(alias: &str) -> String {
    let a = qualifier(alias);
    format!("({a}last_error IS NULL OR {a}last_error NOT LIKE '{SUSPECT}%')")
}

/// Not past its deadline: such a row is never claimed, even in the moment before the expiry
/// sweep marks it (a heap filter on rows the claim reads anyway: free when no row expires).
pub(super) fn not_due(alias: &str) -> String {
    let a = qualifier(alias);
    format!("({a}expires_at IS NULL OR {a}expires_at > now())")
}

/// No open row of the same aggregate comes before the row `alias` of table `t`: it is the
/// head of its aggregate (true of a row without an aggregate). Two probes, one per index: a
/// [`waiting`] row (alias `e` inside) and a row in flight (alias `p`). Kept out of an `OR`, so
/// that the planner can turn them into joins (the rows in flight hashed once) rather than
/// probe the processing index, which is not keyed by aggregate, once per row.
pub(super) fn no_open_row_before(t: &str, alias: &str) -> String {
    let waiting = waiting("e");
    format!(
        "NOT EXISTS (SELECT 1 FROM {t} e WHERE e.aggregate_type = {alias}.aggregate_type \
         AND e.aggregate_id = {alias}.aggregate_id AND {waiting} AND e.seq < {alias}.seq) \
         AND {}",
        no_row_in_flight_before(t, alias)
    )
}

/// No row of the same aggregate as the row `alias` of table `t` is in flight (`processing`)
/// before it. Uses the alias `p` inside.
pub(super) fn no_row_in_flight_before(t: &str, alias: &str) -> String {
    format!(
        "NOT EXISTS (SELECT 1 FROM {t} p WHERE p.status = 'processing' \
         AND p.aggregate_type = {alias}.aggregate_type \
         AND p.aggregate_id = {alias}.aggregate_id AND p.seq < {alias}.seq)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicates_are_qualified_by_the_alias_or_not_at_all() {
        assert_eq!(waiting("e"), "e.status IN ('pending', 'failed')");
        assert_eq!(waiting(""), "status IN ('pending', 'failed')");
        assert_eq!(
            not_suspect("c"),
            "(c.last_error IS NULL OR c.last_error NOT LIKE 'lease expired:%')"
        );
        assert_eq!(not_due(""), "(expires_at IS NULL OR expires_at > now())");
        assert_eq!(
            blocker("u"),
            "u.status = 'failed' OR (u.status = 'pending' AND u.available_at > u.created_at)"
        );
        assert!(ready("c").starts_with("c.available_at <= now() AND (c.last_error IS NULL"));
        let head = no_open_row_before("app.t", "f");
        assert!(
            head.starts_with("NOT EXISTS (SELECT 1 FROM app.t e WHERE"),
            "{head}"
        );
        assert!(head.contains("e.aggregate_id = f.aggregate_id"), "{head}");
        assert!(
            head.contains("e.status IN ('pending', 'failed') AND e.seq < f.seq)"),
            "{head}"
        );
        assert!(
            head.contains("p.status = 'processing' AND p.aggregate_type = f.aggregate_type"),
            "{head}"
        );
        assert!(head.ends_with("AND p.seq < f.seq)"), "{head}");
    }
}
