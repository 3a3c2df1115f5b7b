//! `docs/fsm.md` is generated from the code and must not drift from it.

use std::path::PathBuf;

fn doc_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/fsm.md")
}

#[test]
fn docs_fsm_md_is_up_to_date() {
    let rendered = kvtier_fsm::render_markdown();
    let path = doc_path();
    if std::env::var("KVTIER_UPDATE_DOCS").as_deref() == Ok("1") {
        std::fs::write(&path, &rendered).unwrap();
        return;
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == rendered,
        "{} is out of date with the code; regenerate it with\n    {}",
        path.display(),
        kvtier_fsm::doc::REGENERATE_COMMAND
    );
}

#[test]
fn rendered_docs_cover_every_kind() {
    use strum::IntoEnumIterator;
    let md = kvtier_fsm::render_markdown();
    for k in kvtier_fsm::RequestStateKind::iter() {
        assert!(md.contains(&format!("| {k} |")), "state {k} missing");
    }
    for k in kvtier_fsm::RequestEventKind::iter() {
        assert!(md.contains(&format!("| {k} |")), "event {k} missing");
    }
    for k in kvtier_fsm::OpKind::iter() {
        assert!(md.contains(&format!("| {k} |")), "op kind {k} missing");
    }
    assert!(md.contains("```mermaid\nstateDiagram-v2\n"));
    assert!(md.contains("### Abort deferral"));
}
