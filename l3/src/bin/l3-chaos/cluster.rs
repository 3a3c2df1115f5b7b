//! The split deployment under test: one `--role master` with a state dir and `n` store nodes
//! with SSD dirs, real `kvtier-l3` processes on 127.0.0.1, each of which can be SIGKILLed and
//! restarted with the same identity (the master on the same address and state dir; a node
//! with the same `--node-id` and `--ssd-dir`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::Mode;

/// A running `kvtier-l3` process (SIGKILLed when dropped).
struct Proc {
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Already dead is fine: this is a kill, not a release of anything.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `bin args` and waits for its `LISTENING addr` line.
fn start(bin: &Path, args: &[String]) -> Result<(Proc, SocketAddr), String> {
    let mut child = Command::new(bin)
        .args(args)
        .env_remove("KVTIER_L3_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bin.display()))?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let p = Proc { child };
    let addr = kvtier_l3::cli::read_listening(out).map_err(|e| format!("{e} from {args:?}"))?;
    Ok((p, addr))
}

/// How a node writes SSD copies.
fn node_offload(mode: Mode, i: usize) -> &'static str {
    match mode {
        Mode::WriteThrough => "write-through",
        Mode::OnEvict => "on-evict",
        Mode::Mixed if i.is_multiple_of(2) => "write-through",
        Mode::Mixed => "on-evict",
    }
}

/// The deployment: the master's address never changes across its restarts.
pub struct Cluster {
    bin: PathBuf,
    dir: PathBuf,
    mode: Mode,
    segment_bytes: u64,
    ttl_ms: u64,
    master: Option<Proc>,
    pub master_addr: SocketAddr,
    nodes: Vec<Option<Proc>>,
}

impl Cluster {
    /// Starts the master and `nodes` store nodes under `dir`.
    pub fn start(
        bin: &Path,
        dir: &Path,
        mode: Mode,
        nodes: usize,
        segment_bytes: u64,
        ttl_ms: u64,
    ) -> Result<Self, String> {
        std::fs::create_dir_all(dir.join("master")).map_err(|e| e.to_string())?;
        let mut c = Cluster {
            bin: bin.to_path_buf(),
            dir: dir.to_path_buf(),
            mode,
            segment_bytes,
            ttl_ms,
            master: None,
            master_addr: "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
            nodes: (0..nodes).map(|_| None).collect(),
        };
        c.start_master()?;
        for i in 0..nodes {
            c.start_node(i)?;
        }
        Ok(c)
    }

    fn start_master(&mut self) -> Result<(), String> {
        let args: Vec<String> = [
            "--role",
            "master",
            "--listen",
            &self.master_addr.to_string(),
            "--state-dir",
            &self.dir.join("master").display().to_string(),
            "--client-ttl-ms",
            &self.ttl_ms.to_string(),
            "--lease-ms",
            "500",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (p, addr) = start(&self.bin, &args)?;
        self.master = Some(p);
        self.master_addr = addr;
        Ok(())
    }

    fn start_node(&mut self, i: usize) -> Result<(), String> {
        let ssd = self.dir.join(format!("node{}", i + 1));
        let args: Vec<String> = [
            "--role",
            "node",
            "--listen",
            "127.0.0.1:0",
            "--master",
            &self.master_addr.to_string(),
            "--node-id",
            &(i + 1).to_string(),
            "--ping-ms",
            "100",
            "--segment-bytes",
            &self.segment_bytes.to_string(),
            "--ssd-dir",
            &ssd.display().to_string(),
            "--offload",
            node_offload(self.mode, i),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (p, _) = start(&self.bin, &args)?;
        self.nodes[i] = Some(p);
        Ok(())
    }

    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    pub fn node_up(&self, i: usize) -> bool {
        self.nodes[i].is_some()
    }

    pub fn master_up(&self) -> bool {
        self.master.is_some()
    }

    /// SIGKILL (the drop of [`Proc`]).
    pub fn kill_node(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    pub fn kill_master(&mut self) {
        self.master = None;
    }

    /// Restarts node `i` if it is down (same id, same SSD dir).
    pub fn revive_node(&mut self, i: usize) -> Result<(), String> {
        if self.nodes[i].is_none() {
            self.start_node(i)?;
        }
        Ok(())
    }

    /// Restarts the master if it is down (same address, same state dir). The address may
    /// still be held for a moment after the kill: retried.
    pub fn revive_master(&mut self) -> Result<(), String> {
        let mut last = String::new();
        for _ in 0..50 {
            if self.master.is_some() {
                return Ok(());
            }
            match self.start_master() {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Err(format!("master did not restart: {last}"))
    }

    /// Everything up again.
    pub fn revive_all(&mut self) -> Result<(), String> {
        self.revive_master()?;
        for i in 0..self.nodes.len() {
            let mut tries = 0;
            while let Err(e) = self.revive_node(i) {
                tries += 1;
                if tries == 25 {
                    return Err(format!("node {} did not restart: {e}", i + 1));
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
        Ok(())
    }
}
