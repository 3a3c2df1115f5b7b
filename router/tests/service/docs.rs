//! docs/router.md's `kvtier-router` command line runs (the binary, on a free port instead of
//! the documented one, exiting by itself), and each documented `curl` line is sent to it.
//! The `vllm serve` lines are checked by bindings/tests/vllm_engine/test_router_docs.py.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// The lines of the ```sh blocks.
fn sh_lines(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    for line in md.lines() {
        let t = line.trim();
        if t.starts_with("```") {
            in_sh = !in_sh && t == "```sh";
            continue;
        }
        if in_sh {
            out.push(t.to_string());
        }
    }
    out
}

/// A `curl -s [-X POST] HOST/PATH [-d 'BODY']` line as (method, path, body): POST with a
/// body or `-X POST`, else GET.
fn curl(line: &str) -> (&'static str, String, Option<String>) {
    let rest = line.strip_prefix("curl -s ").expect("curl -s");
    let (post, rest) = match rest.strip_prefix("-X POST ") {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let (url, body) = match rest.split_once(" -d '") {
        Some((u, b)) => (u, Some(b.trim_end_matches('\'').to_string())),
        None => (rest, None),
    };
    let path = url.find('/').map(|i| url[i..].to_string()).expect("a path");
    let method = if post || body.is_some() {
        "POST"
    } else {
        "GET"
    };
    (method, path, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_router_line_and_requests_run() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let md = std::fs::read_to_string(root.join("docs/router.md")).expect("docs/router.md");
    let lines = sh_lines(&md);
    let routers: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("kvtier-router "))
        .collect();
    let curls: Vec<&String> = lines.iter().filter(|l| l.starts_with("curl ")).collect();
    assert_eq!(routers.len(), 1);
    assert!(curls.len() >= 3);
    let mut args: Vec<String> = routers[0]
        .split_whitespace()
        .skip(1)
        .map(String::from)
        .collect();
    let at = args.iter().position(|a| a == "--listen").expect("--listen");
    args[at + 1] = "127.0.0.1:0".into();
    args.extend(["--exit-after-s".into(), "20".into()]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-router"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvtier-router");
    let first = first_line(&mut child).await;
    let addr: std::net::SocketAddr = first
        .trim()
        .strip_prefix("kvtier-router listening on http://")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .parse()
        .expect("address");
    for line in curls {
        let (method, path, body) = curl(line);
        let got =
            crate::common::http(addr, method, &path, body.as_deref().map(str::as_bytes)).await;
        // a booking's reports answer 204 and no body; everything else JSON
        let want = if path.starts_with("/bookings/") {
            204
        } else {
            200
        };
        assert_eq!(
            got.status,
            want,
            "{line}: {:?}",
            String::from_utf8_lossy(&got.body())
        );
        if want == 200 {
            let _: serde_json::Value = got.json();
        }
    }
    // the documented tracked request was booked, and its documented reports ended it
    let stats = crate::common::http(addr, "GET", "/stats", None)
        .await
        .json();
    assert_eq!(stats["bookings"]["open"], 0, "{stats}");
    // no engine publishes: every request above was routed anyway (by load-free estimates)
    let stats = crate::common::http(addr, "GET", "/stats", None)
        .await
        .json();
    assert_eq!(stats["streams"].as_array().map(Vec::len), Some(2));
    // the documented device size is the one in force
    let at = args
        .iter()
        .position(|a| a == "--device-tokens")
        .expect("--device-tokens");
    let device: f64 = args[at + 1].parse().expect("a number");
    assert_eq!(stats["device_tokens"].as_f64(), Some(device), "{stats}");
    // the documented budget is the one in force
    let at = args
        .iter()
        .position(|a| a == "--max-index-bytes")
        .expect("--max-index-bytes");
    let budget: kvtier_router::launch::ByteSize = args[at + 1].parse().expect("a byte size");
    assert_eq!(stats["max_index_bytes"], budget.0, "{stats}");
    assert!(
        stats["memory_bytes"].as_u64() <= Some(budget.0 as u64),
        "{stats}"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// Bad flags exit with 2 (a usage error) before anything starts, never with a panic;
/// instances that disagree on proxying, and endpoint keys that would be ignored (a
/// `replay=` or `topic=` without the `events=` they go with, a `url=` for the store: until
/// 2026-12-07 the router started without them, `--storage replay=…` with no store stream at
/// all), are found at start (1).
#[test]
fn bad_flags_are_errors_not_panics() {
    let ev = "events=tcp://127.0.0.1:1";
    let url = "url=http://127.0.0.1:1";
    for (args, code) in [
        (vec!["--instance", "events=udp://x"], 2),
        (vec!["--instance", "nokey"], 2),
        (vec!["--instance", "url=http://127.0.0.1:1/a b"], 2),
        (vec!["--instance", "url=http://127.0.0.1:port"], 2),
        (vec!["--instance", url, "--page-size", "0"], 2),
        (vec!["--instance", url, "--resync-s", "inf"], 2),
        // below 10 ms it was taken as 10 ms; past what a Duration holds, as 5 s (the default)
        (vec!["--instance", url, "--resync-s", "0.001"], 2),
        (vec!["--instance", url, "--resync-s", "1e300"], 2),
        (vec!["--instance", url, "--instance", ev], 1),
        // keys that would be ignored: a replay or topic with no stream, a URL for the store
        (vec!["--instance", "replay=tcp://127.0.0.1:2"], 1),
        (vec!["--instance", "url=http://127.0.0.1:1,topic=m"], 1),
        (
            vec!["--instance", ev, "--storage", "replay=tcp://127.0.0.1:2"],
            1,
        ),
        (vec!["--instance", ev, "--storage", "topic=ns"], 1),
        (
            vec![
                "--instance",
                ev,
                "--storage",
                "events=tcp://127.0.0.1:2,url=http://127.0.0.1:3",
            ],
            1,
        ),
        (vec!["--instance", ev, "--storage", ""], 1),
        (vec![], 2),
        (vec!["--instance", ev, "--max-index-bytes", "0"], 2),
        (vec!["--instance", ev, "--max-index-bytes", "lots"], 2),
        (vec!["--instance", ev, "--max-index-bytes", "1.5GiB"], 2),
        (vec!["--instance", ev, "--max-index-bytes", "-1"], 2),
        // below an empty index's bytes
        (vec!["--instance", ev, "--max-index-bytes", "8"], 2),
        (vec!["--instance", ev, "--max-pages", "0"], 2),
        // 0 was taken as 1 ms: a replay or snapshot answer slower than that was given up on
        (vec!["--instance", ev, "--replay-timeout-ms", "0"], 2),
        (vec!["--instance", ev, "--delay-weight", "-1"], 2),
        (vec!["--instance", ev, "--delay-weight", "NaN"], 2),
        (vec!["--instance", ev, "--booking-ttl-s", "0"], 2),
        (vec!["--instance", ev, "--booking-ttl-s", "NaN"], 2),
        (vec!["--instance", ev, "--device-tokens", "131072"], 2),
        (vec!["--instance", ev, "--decode-step-ms", "6"], 2),
        (
            vec![
                "--instance",
                ev,
                "--device-tokens",
                "0",
                "--decode-step-ms",
                "6",
            ],
            2,
        ),
        (
            vec![
                "--instance",
                ev,
                "--device-tokens",
                "131072",
                "--decode-step-ms",
                "inf",
            ],
            2,
        ),
        (vec!["--instance", ev, "--head-timeout-s", "-1"], 2),
        (vec!["--instance", ev, "--head-timeout-s", "NaN"], 2),
        (vec!["--instance", ev, "--head-timeout-s", "inf"], 2),
        (vec!["--instance", ev, "--head-timeout-s", "0"], 0),
        (vec!["--instance", ev, "--header-timeout-s", "0"], 2),
        (vec!["--instance", ev, "--header-timeout-s", "-1"], 2),
        (vec!["--instance", ev, "--header-timeout-s", "NaN"], 2),
        (vec!["--instance", ev, "--header-timeout-s", "inf"], 2),
        (vec!["--instance", ev, "--header-timeout-s", "2.5"], 0),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier-router"))
            .args(&args)
            .args(["--listen", "127.0.0.1:0", "--exit-after-s", "0.1"])
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The binary raises its soft limit of open files to the hard one at start (as vLLM does):
/// each proxied request holds two sockets, and the common soft limit of 1,024 ran out at
/// ~500 concurrent streams (before: every connect past it failed, read as the instance
/// refusing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_raises_its_open_files_limit_to_the_hard_one() {
    let mut child = Command::new("sh")
        .args([
            "-c",
            "ulimit -Sn 64 && ulimit -Hn 256 && exec \"$0\" \"$@\"",
            env!("CARGO_BIN_EXE_kvtier-router"),
            "--instance",
            "url=http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            "--exit-after-s",
            "20",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvtier-router");
    let first = first_line(&mut child).await;
    assert!(first.contains("listening"), "{first}");
    let limits =
        std::fs::read_to_string(format!("/proc/{}/limits", child.id())).expect("/proc limits");
    let _ = child.kill();
    let out = child.wait_with_output().expect("wait");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("open files line");
    let nums: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(nums, ["256", "256"], "{line}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("open files: 256"), "it says so: {err}");
}

/// `--header-timeout-s` reaches the server: a connection that never finishes its head is
/// closed after it (0.3 s here; the default, 30 s, would outlast the test). Before, the
/// binary had no such flag and always took the default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_timeout_flag_closes_a_half_sent_head() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier-router"))
        .args([
            "--instance",
            "url=http://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--header-timeout-s", "0.3", "--exit-after-s", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kvtier-router");
    let first = first_line(&mut child).await;
    let addr = first
        .trim()
        .strip_prefix("kvtier-router listening on http://")
        .unwrap_or_default()
        .to_string();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let mut b = [0u8; 256];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        closed.is_ok(),
        "the half-sent head was still open after 10 s"
    );
}

/// The first line a started `kvtier-router` prints (its address), read off the blocking
/// runtime; empty if it printed none.
async fn first_line(child: &mut std::process::Child) -> String {
    let stdout = child.stdout.take().expect("stdout");
    tokio::task::spawn_blocking(move || {
        let mut l = String::new();
        let _ = BufReader::new(stdout).read_line(&mut l);
        l
    })
    .await
    .expect("read")
}
