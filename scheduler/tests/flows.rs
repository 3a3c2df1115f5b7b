//! One test per flow of the scheduler, each driven through the checking test engine.

mod common;
use common::*;
use kvtier_scheduler::*;

#[test]
fn single_request_runs_to_completion_and_writes_back() {
    let c = cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 30), 5);
    e.run_to_idle(&mut s, 100);
    assert_eq!(e.ended, vec![(RequestId(1), Outcome::Finished)]);
    assert_eq!(e.tokens[&RequestId(1)].len(), 35);
    // 34 tokens have KV -> 8 full pages, written back to host.
    assert_eq!(s.stats().host.cached, 8);
    assert_eq!(s.stats().op(OpKind::WriteBack).succeeded, 1);
    assert_quiescent(&s);
}

#[test]
fn resubmitted_prompt_hits_device_then_host_with_load_back() {
    let c = cfg();
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 40), 2);
    e.run_to_idle(&mut s, 100);
    e.submit(&mut s, 2, prompt(1, 40), 2);
    e.run_to_idle(&mut s, 100);
    let st = s.stats();
    assert_eq!(
        st.device_hit_pages, 9,
        "(40-1)/4 = 9 usable pages on device"
    );
    // Push the prefix out of device with other prompts, then come back: host hit + load-back.
    for i in 0..6 {
        e.submit(&mut s, 10 + i, prompt(100 + i as u32, 40), 2);
    }
    e.run_to_idle(&mut s, 200);
    let before = s.stats();
    e.submit(&mut s, 3, prompt(1, 40), 2);
    e.run_to_idle(&mut s, 100);
    let after = s.stats();
    assert!(after.host_hit_pages > before.host_hit_pages, "{after:?}");
    assert!(after.op(OpKind::LoadBack).succeeded > before.op(OpKind::LoadBack).succeeded);
    assert!(e.pages_checked > 0);
    assert_quiescent(&s);
}

#[test]
fn chunked_prefill_respects_budget_and_publishes_each_chunk() {
    let mut c = cfg();
    c.chunked_prefill_size = 8;
    c.token_budget = 8;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    e.submit(&mut s, 1, prompt(1, 30), 3);
    let plan = s.next_execution_plan(0);
    assert_eq!(plan.forward.prefill.len(), 1);
    assert_eq!(plan.forward.prefill[0].len, 8);
    e.take_plan(plan);
    e.complete_forward(&mut s);
    // After one chunk of 8 tokens, 2 pages are already in the tree: a second request with
    // the same prefix matches them before the first finishes.
    assert_eq!(
        s.cache()
            .peek_prefix(&kvtier_radix::page_hashes(&prompt(1, 30), 4, None))
            .0,
        2
    );
    e.submit(&mut s, 2, prompt(1, 30), 3);
    e.run_to_idle(&mut s, 100);
    assert!(s.stats().device_hit_pages >= 2);
    assert_quiescent(&s);
}

#[test]
fn batch_size_and_token_budget_bound_each_step() {
    let mut c = cfg();
    c.max_batch_size = 3;
    c.token_budget = 40;
    c.device_pages = 64;
    let mut s = Scheduler::new(c.clone()).unwrap();
    let mut e = Engine::new(&c);
    for i in 0..6 {
        e.submit(&mut s, i, prompt(i as u32 + 1, 12), 4);
    }
    e.run_watching(&mut s, 60, |plan| {
        let f = &plan.forward;
        assert!(f.rows() <= 3);
        let toks: u32 = f.prefill.iter().map(|c| c.len).sum::<u32>() + f.decode.len() as u32;
        assert!(toks <= 40);
    });
    assert_quiescent(&s);
}
