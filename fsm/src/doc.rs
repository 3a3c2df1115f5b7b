//! Renders `docs/fsm.md` from the code.
//!
//! Why: documentation of a state machine that is written by hand drifts from the machine within
//! weeks. Here the document is a function of the tables in [`crate::table`], of the kinds `strum`
//! derives, and of short descriptions kept next to this renderer in exhaustive `match`es (adding
//! a state or event without describing it does not compile). The test
//! `docs_fsm_md_is_up_to_date` compares the committed file with [`render_markdown`] and fails on
//! any difference; run it with `KVTIER_UPDATE_DOCS=1` to rewrite the file.
//!
//! How: plain string building, deterministic (tables in declaration order, `strum` iteration
//! order for kinds), GitHub-flavoured Markdown tables plus a Mermaid `stateDiagram-v2` of the
//! request machine.

use std::fmt::Display;

use strum::IntoEnumIterator;

use crate::error::IllegalReason;
use crate::op::{OpEventKind, OpKind, OpState};
use crate::request::{RequestEventKind, RequestStateKind};
use crate::table::{Row, op_table, request_table};

/// The command that regenerates the document, printed in its header.
pub const REGENERATE_COMMAND: &str =
    "KVTIER_UPDATE_DOCS=1 cargo test -p kvtier-fsm --test docs docs_fsm_md_is_up_to_date";

fn describe_state(kind: RequestStateKind) -> &'static str {
    use RequestStateKind as S;
    match kind {
        S::Submitted => "Waiting to be scheduled: new, after an L3 probe, or resumed.",
        S::Querying => {
            "`{ abort_pending }`: an `L3Query` (existence probe, no allocation) is in flight."
        }
        S::Prefetching => {
            "`{ start_page, pages, abort_pending }`: a `Prefetch` op (L3 → host) for prompt pages `start_page .. start_page + pages` is in flight; `start_page` is the device/host match the L3 keys were computed against."
        }
        S::PrefetchDone => {
            "`{ start_page, completed }`: the prefetch came back with `completed` pages on host (may be fewer than asked, or 0); insert them at `start_page`, not at the current host match."
        }
        S::Prefilling => {
            "`{ total, done, scheduled, chunks, abort_pending }`: chunked prefill, token counts; a chunk is in flight iff `scheduled > done`; `done` includes the cached prefix."
        }
        S::Decoding => {
            "`{ generated, in_flight, abort_pending }`: generating; `generated` counts tokens since the last prefill finished."
        }
        S::Draining => {
            "`{ pages }`: finished generating; `pages` device pages to write back to host."
        }
        S::WritingBack => {
            "`{ pages, abort_pending }`: a `WriteBack` op (device → host) for the finished request is in flight."
        }
        S::BackingUp => {
            "`{ outstanding, abort_pending }`: host → L3 backups tied to the request are in flight; their host pages stay locked."
        }
        S::Retracting => {
            "`{ pages, abort_pending }`: preempted; the victim pages are being written back to host."
        }
        S::Retracted => {
            "`{ saved }`: preempted, waiting to resume; `saved` = the pages reached host (load back instead of recompute)."
        }
        S::Finished => "Terminal: done.",
        S::Aborted => "Terminal: aborted.",
        S::Failed => "Terminal: `{ reason: OpFailed | OutOfMemory | Internal }`.",
    }
}

fn describe_event(kind: RequestEventKind) -> &'static str {
    use RequestEventKind as E;
    match kind {
        E::ScheduleQuery => "Send an L3 existence probe.",
        E::QueryDone => "`{ hit_pages }`: the probe came back.",
        E::SchedulePrefetch => {
            "`{ start_page, pages }`: prefetch prompt pages `start_page .. start_page + pages` from L3 to host."
        }
        E::PrefetchDone => "`{ completed }`: the prefetch came back; partial success is normal.",
        E::ScheduleFirstChunk => {
            "`{ total, cached, tokens }`: schedule the first prefill chunk after a cached prefix."
        }
        E::ScheduleNextChunk => "`{ tokens }`: schedule the next prefill chunk.",
        E::PrefillDone => "The in-flight prefill chunk completed.",
        E::ScheduleDecode => "Put the request in the next decode batch.",
        E::DecodeStep => "The in-flight decode step produced one token.",
        E::Finish => "`{ pages_to_write_back }`: generation is over.",
        E::CommitDraining => {
            "Issue the write-back, or finish at once if there is nothing to write."
        }
        E::WriteBackDone => {
            "`{ success, backups }`: the write-back came back; `backups` = host → L3 backup ops issued for the request."
        }
        E::BackupDone => "One backup op tied to the request completed.",
        E::Retract => "`{ write_back_pages }`: preempt the request to free device memory.",
        E::ResumeFromRetracted => "Put a retracted request back in the queue.",
        E::Abort => {
            "Abort: immediate when nothing is in flight, deferred to the completion otherwise."
        }
        E::Fail => "`{ reason }`: fail the request; needs nothing in flight.",
    }
}

fn describe_op_state(state: OpState) -> &'static str {
    match state {
        OpState::Pending => "Created by the scheduler, not yet handed to the engine.",
        OpState::Issued => "Handed to the engine; exactly one completion is owed.",
        OpState::Done => "Terminal: completed successfully.",
        OpState::Failed => "Terminal: completed unsuccessfully.",
        OpState::Cancelled => "Terminal: dropped before it was issued.",
    }
}

fn describe_op_event(kind: OpEventKind) -> &'static str {
    match kind {
        OpEventKind::Issue => "The op was handed to the engine.",
        OpEventKind::Complete => "`{ success }`: the engine's one completion for the op.",
        OpEventKind::Cancel => "Drop an op that was never issued.",
    }
}

fn describe_op_kind(kind: OpKind) -> &'static str {
    match kind {
        OpKind::LoadBack => "Copy pages host → device.",
        OpKind::WriteBack => "Copy pages device → host.",
        OpKind::Prefetch => "Fetch pages L3 → host.",
        OpKind::BackUp => "Store pages host → L3.",
        OpKind::L3Query => "Probe L3 for keys; moves no data and allocates nothing.",
    }
}

/// Escapes a table cell: `|` would end the cell.
fn cell(text: impl Display) -> String {
    text.to_string().replace('|', "\\|")
}

fn push_line(out: &mut String, text: &str) {
    out.push_str(text);
    out.push('\n');
}

fn join<T: Display>(items: &[T], sep: &str) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(sep)
}

fn push_transition_table<K: Display + Copy, V: Display + Copy>(
    out: &mut String,
    rows: &[Row<K, V>],
) {
    push_line(out, "| From | Event | To | Guard / effect |");
    push_line(out, "| --- | --- | --- | --- |");
    for r in rows {
        push_line(
            out,
            &format!(
                "| {} | {} | {} | {} |",
                r.from,
                r.event,
                join(r.to, ", "),
                cell(r.guard)
            ),
        );
    }
}

/// The Mermaid diagram of the request machine, without `Abort`/`Fail` edges and without the
/// completions that end a pending abort (the tables list those).
fn request_mermaid(out: &mut String) {
    use RequestEventKind as E;
    use RequestStateKind as S;
    // (from, to) → events, in table order of first appearance.
    let mut edges: Vec<((S, S), Vec<E>)> = Vec::new();
    for r in request_table() {
        if matches!(r.event, E::Abort | E::Fail) {
            continue;
        }
        for &to in r.to {
            if to == S::Aborted {
                continue;
            }
            match edges.iter_mut().find(|(k, _)| *k == (r.from, to)) {
                Some((_, events)) => events.push(r.event),
                None => edges.push(((r.from, to), vec![r.event])),
            }
        }
    }
    push_line(out, "```mermaid");
    push_line(out, "stateDiagram-v2");
    push_line(out, "    [*] --> Submitted");
    for ((from, to), events) in &edges {
        push_line(
            out,
            &format!("    {from} --> {to} : {}", join(events, " / ")),
        );
    }
    for kind in S::iter().filter(|k| k.is_terminal()) {
        push_line(out, &format!("    {kind} --> [*]"));
    }
    push_line(
        out,
        "    note right of Aborted : Abort from any live state (deferred while something is in flight)",
    );
    push_line(
        out,
        "    note right of Failed : Fail from any live state with nothing in flight",
    );
    push_line(out, "```");
}

fn op_mermaid(out: &mut String) {
    push_line(out, "```mermaid");
    push_line(out, "stateDiagram-v2");
    push_line(out, "    [*] --> Pending");
    for r in op_table() {
        for to in r.to {
            push_line(out, &format!("    {} --> {to} : {}", r.from, r.event));
        }
    }
    for state in OpState::iter().filter(|s| s.is_terminal()) {
        push_line(out, &format!("    {state} --> [*]"));
    }
    push_line(out, "```");
}

/// Renders the whole of `docs/fsm.md`.
pub fn render_markdown() -> String {
    use RequestStateKind as S;
    let mut out = String::new();
    let o = &mut out;

    push_line(o, "# kvtier state machines");
    push_line(o, "");
    push_line(
        o,
        "<!-- Generated from the code of the `kvtier-fsm` crate (`kvtier_fsm::render_markdown`). Do not edit by hand. -->",
    );
    push_line(
        o,
        &format!("<!-- Regenerate with: {REGENERATE_COMMAND} -->"),
    );
    push_line(o, "");
    push_line(
        o,
        "kvtier tracks every request and every cache operation with an explicit state machine \
         (crate `kvtier-fsm`, directory `fsm/`). A transition is a pure function \
         `apply(state, event) -> Result<state, IllegalTransition>`: an illegal event is a typed \
         error that carries the untouched state, the event and an `IllegalReason`; nothing \
         panics and no state is lost. The tables below are the data in `fsm/src/table.rs`; tests \
         hold `apply` to them (every successful transition lands in a listed target, every pair \
         without a row is always illegal, every listed target is reached).",
    );
    push_line(o, "");

    // ---- Request machine ------------------------------------------------------------------
    push_line(o, "## Request machine");
    push_line(o, "");
    push_line(o, "### States");
    push_line(o, "");
    push_line(o, "| State | Terminal | Meaning |");
    push_line(o, "| --- | --- | --- |");
    for kind in S::iter() {
        let terminal = if kind.is_terminal() { "yes" } else { "" };
        push_line(
            o,
            &format!("| {kind} | {terminal} | {} |", cell(describe_state(kind))),
        );
    }
    push_line(o, "");
    push_line(o, "### Events");
    push_line(o, "");
    push_line(o, "| Event | Sender | Meaning |");
    push_line(o, "| --- | --- | --- |");
    for kind in RequestEventKind::iter() {
        let sender = if kind.is_completion() {
            "completion"
        } else {
            "scheduler"
        };
        push_line(
            o,
            &format!("| {kind} | {sender} | {} |", cell(describe_event(kind))),
        );
    }
    push_line(o, "");
    push_line(o, "### Transitions");
    push_line(o, "");
    push_line(
        o,
        "Every `(state, event)` pair not listed is illegal. Terminal states accept no event.",
    );
    push_line(o, "");
    push_transition_table(o, request_table());
    push_line(o, "");

    push_line(o, "### Abort deferral");
    push_line(o, "");
    push_line(
        o,
        "`Abort` is accepted in every live state. When nothing is in flight the request goes to \
         `Aborted` at once. When something is in flight — a completion is owed by the engine — the \
         abort is *deferred*: the state only sets `abort_pending = true`, and the matching \
         completion then ends the request in `Aborted` instead of moving on. This keeps the \
         request (and the pages its in-flight operation uses) alive until the engine is done \
         with them; an abort never loses a pending completion. While an abort is pending the \
         completion is the only accepted event; a second `Abort` is refused with \
         `AbortAlreadyPending`, so duplicated aborts are visible. A successful write-back of a \
         finished request that issued backups moves to `BackingUp` with the pending abort \
         carried over, and the last `BackupDone` ends in `Aborted`.",
    );
    push_line(o, "");
    push_line(
        o,
        "| In-flight state | Completion that ends a pending abort |",
    );
    push_line(o, "| --- | --- |");
    let deferring = request_table()
        .iter()
        .filter(|r| r.event == RequestEventKind::Abort && r.to.contains(&r.from))
        .map(|r| r.from);
    for from in deferring {
        let completions: Vec<_> = request_table()
            .iter()
            .filter(|r| r.from == from && r.event.is_completion() && r.to.contains(&S::Aborted))
            .map(|r| r.event)
            .collect();
        let condition = match from {
            S::Prefilling => " (chunk in flight)",
            S::Decoding => " (`in_flight`)",
            _ => "",
        };
        push_line(
            o,
            &format!("| {from}{condition} | {} |", join(&completions, ", ")),
        );
    }
    push_line(o, "");

    push_line(o, "### Invariants");
    push_line(o, "");
    push_line(
        o,
        "Every state `apply` produces satisfies these; a state that breaks one (built by hand or \
         deserialized) refuses every event with `InconsistentState`.",
    );
    push_line(o, "");
    for line in [
        "`abort_pending` implies something is in flight.",
        "`Prefetching.pages`, `WritingBack.pages`, `Retracting.pages`, `BackingUp.outstanding` are > 0.",
        "`Prefetching`: `start_page + pages` fits in `u32` (so does `start_page + completed` in `PrefetchDone`).",
        "`Prefilling`: `done <= scheduled <= total`, `done < total`, `chunks >= 1`.",
        "`Decoding`: `generated >= 1`; while `in_flight`, `generated < u32::MAX`.",
        "Counters are bumped with checked arithmetic when work is *scheduled*, so a completion is never refused for overflow.",
    ] {
        push_line(o, &format!("- {line}"));
    }
    push_line(o, "");

    push_line(o, "### Diagram");
    push_line(o, "");
    push_line(
        o,
        "`Abort`/`Fail` edges and the completions that end a pending abort are left out; the \
         transition table lists them.",
    );
    push_line(o, "");
    request_mermaid(o);
    push_line(o, "");

    // ---- Cache-op machine -----------------------------------------------------------------
    push_line(o, "## Cache-op machine");
    push_line(o, "");
    push_line(
        o,
        "One machine for every kind of cache operation. An issued op must come back through \
         exactly one `Complete`; `Cancel` is only for ops never handed to the engine.",
    );
    push_line(o, "");
    push_line(o, "| Op kind | Route | Meaning |");
    push_line(o, "| --- | --- | --- |");
    for kind in OpKind::iter() {
        let route = match kind.route() {
            Some((from, to)) => format!("{from} → {to}"),
            None => "-".to_owned(),
        };
        push_line(
            o,
            &format!("| {kind} | {route} | {} |", cell(describe_op_kind(kind))),
        );
    }
    push_line(o, "");
    push_line(o, "| State | Terminal | Meaning |");
    push_line(o, "| --- | --- | --- |");
    for state in OpState::iter() {
        let terminal = if state.is_terminal() { "yes" } else { "" };
        push_line(
            o,
            &format!(
                "| {state} | {terminal} | {} |",
                cell(describe_op_state(state))
            ),
        );
    }
    push_line(o, "");
    push_line(o, "| Event | Meaning |");
    push_line(o, "| --- | --- |");
    for kind in OpEventKind::iter() {
        push_line(
            o,
            &format!("| {kind} | {} |", cell(describe_op_event(kind))),
        );
    }
    push_line(o, "");
    push_transition_table(o, op_table());
    push_line(o, "");
    op_mermaid(o);
    push_line(o, "");

    // ---- Reasons --------------------------------------------------------------------------
    push_line(o, "## Why an event is refused");
    push_line(o, "");
    push_line(o, "| `IllegalReason` | Meaning |");
    push_line(o, "| --- | --- |");
    for reason in IllegalReason::iter() {
        let name: &'static str = reason.into();
        push_line(o, &format!("| {name} | {} |", cell(reason)));
    }
    out
}
