//! A real headless Chromium (Debian's `chromium`) driven through the DevTools
//! protocol over `--remote-debugging-pipe`: commands go in on the browser's fd
//! 3, replies and events come out of its fd 4, each a JSON message ended by a
//! NUL byte. Enough to load a page, click, type, read the DOM and take
//! screenshots, with every console error and uncaught exception kept.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

use super::repo;

/// How long one reply may take.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// The browser the tests drive: `PYPROBE_CHROMIUM`, else Debian's.
fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("PYPROBE_CHROMIUM") {
        return PathBuf::from(p);
    }
    for p in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if Path::new(p).exists() {
            return PathBuf::from(p);
        }
    }
    panic!(
        "the HTML report tests need Chromium: `scripts/setup-test-machine.sh` installs \
         Debian's package `chromium` (or set PYPROBE_CHROMIUM to a Chromium binary)"
    );
}

/// A pipe whose ends are numbered 10 or more, so that moving them to 3 and 4
/// in the child cannot overwrite one with the other.
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(rc, 0, "pipe2: {}", std::io::Error::last_os_error());
    let high = |fd: i32| {
        // SAFETY: fcntl on a descriptor this function owns; the original is closed.
        let moved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
        assert!(moved >= 10, "fcntl: {}", std::io::Error::last_os_error());
        unsafe { libc::close(fd) };
        // SAFETY: just made, owned by nothing else.
        unsafe { OwnedFd::from_raw_fd(moved) }
    };
    (high(fds[0]), high(fds[1]))
}

/// One page in a headless Chromium.
pub struct Browser {
    child: Child,
    to_browser: File,
    from_browser: Receiver<Value>,
    next_id: u64,
    session: String,
    /// Console errors and uncaught exceptions, as the page reported them.
    pub errors: Vec<String>,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium with a blank page of `width` × `height` CSS pixels.
    pub fn launch(width: u32, height: u32) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let (commands_read, commands_write) = pipe();
        let (replies_read, replies_write) = pipe();
        let (cr, rw) = (commands_read.as_raw_fd(), replies_write.as_raw_fd());
        let mut cmd = Command::new(chromium());
        cmd.args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls (dup2) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(cr, 3) < 0 || libc::dup2(rw, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start chromium");
        drop(commands_read);
        drop(replies_write);
        let (tx, rx) = channel();
        let replies = File::from(replies_read);
        std::thread::spawn(move || {
            let mut reader = BufReader::new(replies);
            let mut message = Vec::new();
            loop {
                message.clear();
                match reader.read_until(0, &mut message) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                if message.last() == Some(&0) {
                    message.pop();
                }
                let Ok(v) = serde_json::from_slice::<Value>(&message) else {
                    continue;
                };
                if tx.send(v).is_err() {
                    return;
                }
            }
        });
        let mut browser = Browser {
            child,
            to_browser: File::from(commands_write),
            from_browser: rx,
            next_id: 0,
            session: String::new(),
            errors: Vec::new(),
            _profile: profile,
        };
        let target = browser.call_browser("Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().unwrap().to_owned();
        let attached = browser.call_browser(
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
        );
        browser.session = attached["sessionId"].as_str().unwrap().to_owned();
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            browser.call(domain, json!({}));
        }
        browser.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        );
        browser
    }

    fn send(&mut self, method: &str, params: Value, session: Option<String>) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            message["sessionId"] = Value::String(s);
        }
        let mut bytes = serde_json::to_vec(&message).unwrap();
        bytes.push(0);
        self.to_browser
            .write_all(&bytes)
            .expect("write to chromium");
        let deadline = Instant::now() + REPLY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .from_browser
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("chromium did not answer {method} in time"));
            if v["id"].as_u64() == Some(id) {
                if let Some(e) = v.get("error") {
                    panic!("chromium refused {method}: {e}");
                }
                return v["result"].clone();
            }
            self.note_event(&v);
        }
    }

    fn call_browser(&mut self, method: &str, params: Value) -> Value {
        self.send(method, params, None)
    }

    /// Sends a command to the page and returns its result.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        let session = Some(self.session.clone());
        self.send(method, params, session)
    }

    /// Keeps what an event says of errors.
    fn note_event(&mut self, v: &Value) {
        let p = &v["params"];
        match v["method"].as_str() {
            Some("Runtime.exceptionThrown") => {
                let d = &p["exceptionDetails"];
                self.errors.push(format!(
                    "uncaught: {} {}",
                    d["text"].as_str().unwrap_or(""),
                    d["exception"]["description"].as_str().unwrap_or("")
                ));
            }
            Some("Runtime.consoleAPICalled") if p["type"] == "error" || p["type"] == "assert" => {
                self.errors
                    .push(format!("console.{}: {}", p["type"], p["args"]));
            }
            Some("Log.entryAdded") if p["entry"]["level"] == "error" => {
                self.errors.push(format!(
                    "log: {}",
                    p["entry"]["text"].as_str().unwrap_or("")
                ));
            }
            _ => {}
        }
    }

    /// Reads what has arrived without waiting.
    pub fn drain_events(&mut self) {
        while let Ok(v) = self.from_browser.try_recv() {
            self.note_event(&v);
        }
    }

    /// Opens `file` and waits until its script says it is ready
    /// (`document.body.dataset.ready`).
    pub fn open(&mut self, file: &Path) {
        let url = format!("file://{}", file.display());
        self.call("Page.navigate", json!({"url": url}));
        let deadline = Instant::now() + REPLY_TIMEOUT;
        while self.eval("document.readyState === 'complete' && document.body.dataset.ready === '1'")
            != Value::Bool(true)
        {
            self.drain_events();
            assert!(
                Instant::now() < deadline,
                "{} never finished drawing; errors: {:?}",
                file.display(),
                self.errors
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.drain_events();
    }

    /// The value of a JavaScript expression (returned by value).
    pub fn eval(&mut self, expression: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{expression} threw: {e}");
        }
        r["result"]["value"].clone()
    }

    /// A left click at (`x`, `y`), as a mouse does it.
    pub fn click(&mut self, x: f64, y: f64) {
        for (kind, buttons) in [("mouseMoved", 0), ("mousePressed", 1), ("mouseReleased", 0)] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({"type": kind, "x": x, "y": y, "button": "left", "buttons": buttons, "clickCount": 1}),
            );
        }
    }

    /// Types `text` into the focused element.
    pub fn type_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({"text": text}));
    }

    /// A screenshot of the whole page, kept as a test artefact at
    /// `target/test-artifacts/NAME.png`; returns its path.
    pub fn screenshot(&mut self, name: &str) -> PathBuf {
        let r = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true}),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap();
        let dir = repo().join("target/test-artifacts");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, &png).unwrap();
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
