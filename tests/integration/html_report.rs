//! `report --format html` opened in a real headless Chromium: the page loads
//! with no console error, its numbers are the report's, a click zooms, a
//! search (by name and by `file:line`) highlights what it should and says its
//! share, the inverted graph starts from the hottest function. Screenshots go
//! to `target/test-artifacts/`.

use std::path::Path;

use serde_json::Value;

use crate::support::browser::Browser;
use crate::support::*;

/// Records fixtures/demo.py for a second and a half.
fn record_demo(py: &Python, extra: &[&str], out: &Path) {
    record_script_into(py, extra, out, "../demo.py", &["--seconds", "1.5"]);
}

/// `report -o X.html`: the page (its name chooses the format).
fn write_page(recording: &Path) -> std::path::PathBuf {
    let page = recording.with_extension("html");
    let out = run_pyprobe(&[
        "report",
        recording.to_str().unwrap(),
        "-o",
        page.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "report --format html failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    page
}

/// The functions of the report's with the most of `key`: several where they tie
/// (a sampled run's few samples often do), in which case the page may show any
/// of them first.
fn tops_by<'a>(report: &'a Value, key: &dyn Fn(&Value) -> u64) -> Vec<&'a Value> {
    let functions = report["functions"].as_array().unwrap();
    let most = functions.iter().map(key).max().unwrap();
    functions.iter().filter(|f| key(f) == most).collect()
}

/// The one of `tops` named `name`.
fn one_of<'a>(tops: &[&'a Value], name: &Value) -> &'a Value {
    let names: Vec<&Value> = tops.iter().map(|f| &f["qualname"]).collect();
    tops.iter()
        .find(|f| &f["qualname"] == name)
        .unwrap_or_else(|| panic!("{name} is not one of the tops {names:?}"))
}

/// The first row of the hot spots names one of `tops`, and its column `column`
/// holds that function's `key`.
fn assert_first_hot_spot(browser: &mut Browser, tops: &[&Value], column: usize, key: &str) {
    let row = browser
        .eval("[...document.querySelector('#hotspots tbody tr').cells].map((c) => c.textContent)");
    let top = one_of(tops, &row[0]);
    assert_eq!(
        row[column].as_str().unwrap().replace(',', ""),
        top[key].to_string()
    );
}

/// The report's row of the function named `name`.
fn function_named<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["functions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["function"] == name)
        .unwrap_or_else(|| panic!("no {name} in the report"))
}

/// The flame graph box of the widest frame named `name`: its node and rectangle.
fn widest_box(browser: &mut Browser, name: &str) -> (u64, [f64; 4]) {
    let v = browser.eval(&format!(
        "(() => {{ const b = [...document.querySelectorAll('#flame .f')]
            .filter((b) => window.pyprobe.data.frames.name[window.pyprobe.state.tree.frame[b.dataset.node]] === {name:?})
            .map((b) => {{ const r = b.getBoundingClientRect(); return [Number(b.dataset.node), r.x, r.y, r.width, r.height]; }})
            .sort((a, b) => b[3] - a[3]);
          return b[0] || null; }})()"
    ));
    let a = v
        .as_array()
        .unwrap_or_else(|| panic!("no box named {name}"));
    let f = |i: usize| a[i].as_f64().unwrap();
    (a[0].as_u64().unwrap(), [f(1), f(2), f(3), f(4)])
}

fn flame_width(browser: &mut Browser) -> f64 {
    browser
        .eval("document.getElementById('flame').clientWidth")
        .as_f64()
        .unwrap()
}

fn click_element(browser: &mut Browser, selector: &str) {
    let r = browser.eval(&format!(
        "(() => {{ const r = document.querySelector({selector:?}).getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
    ));
    browser.click(r[0].as_f64().unwrap(), r[1].as_f64().unwrap());
}

fn search(browser: &mut Browser, text: &str) {
    browser.eval("(() => { const s = document.getElementById('search'); s.value = ''; s.dispatchEvent(new Event('input')); })()");
    click_element(browser, "#search");
    browser.type_text(text);
}

/// A sampled run of the demo on 3.13: every number the page draws checked
/// against the report, and the interactions a user tries first.
#[test]
fn a_sampled_html_report_loads_zooms_and_searches_in_chromium() {
    let Some(py) = python("3.13") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("demo.pyprobe");
    record_demo(&py, &[], &recording);
    let report = report_json(recording.to_str().unwrap());
    let page = write_page(&recording);
    let interval = report["sample_interval_ns"].as_u64().unwrap();
    assert!(interval > 0, "a sampled recording");

    let mut browser = Browser::launch(1400, 1000);
    browser.open(&page);
    assert!(browser.errors.is_empty(), "errors: {:?}", browser.errors);

    // The graph holds every sample counted.
    let kept = report["sample_filter"]["kept"].as_u64().unwrap();
    assert_eq!(browser.eval("window.pyprobe.state.tree.total[0]"), kept);

    // The first hot spot is the function with the most own samples.
    let tops = tops_by(&report, &|f| f["samples"].as_u64().unwrap());
    assert_first_hot_spot(&mut browser, &tops, 2, "samples");

    // A click on fib zooms to it: it then spans the graph.
    let width = flame_width(&mut browser);
    let (node, [x, y, w, h]) = widest_box(&mut browser, "fib");
    assert!(
        w < width - 10.0,
        "fib is not the whole graph before the zoom"
    );
    browser.click(x + w / 2.0, y + h / 2.0);
    assert_eq!(browser.eval("window.pyprobe.state.zoom"), node);
    let (_, [x2, _, w2, _]) = widest_box(&mut browser, "fib");
    let left = browser
        .eval("document.getElementById('flame').getBoundingClientRect().x")
        .as_f64()
        .unwrap();
    assert!(
        w2 >= width - 2.0 && (x2 - left).abs() < 1.0,
        "zoomed fib is {w2} px of {width}, at {x2} (the graph at {left})"
    );
    browser.screenshot("html-report-sampled-zoomed");
    click_element(&mut browser, "#reset");
    assert_eq!(browser.eval("window.pyprobe.state.zoom"), 0);

    // Searching by name: fib's boxes light up, and the share said is fib's
    // total samples, as the report has them.
    let fib = function_named(&report, "fib");
    search(&mut browser, "fib");
    assert_eq!(browser.eval("window.pyprobe.state.hits"), 1);
    assert_eq!(
        browser
            .eval("window.pyprobe.state.matched")
            .as_u64()
            .unwrap()
            * interval,
        fib["inclusive_ns"].as_u64().unwrap()
    );
    let lit = browser.eval(
        "[...document.querySelectorAll('#flame .f.hit')].map((b) => window.pyprobe.data.frames.name[window.pyprobe.state.tree.frame[b.dataset.node]])",
    );
    let lit = lit.as_array().unwrap();
    assert!(!lit.is_empty() && lit.iter().all(|n| n == "fib"), "{lit:?}");
    let said = browser.eval("document.getElementById('matches').textContent");
    assert!(
        said.as_str().unwrap().contains("1 function matches"),
        "{said}"
    );
    browser.screenshot("html-report-sampled-search");

    // By file:line: the function defined there.
    search(&mut browser, &format!("demo.py:{}", fib["line"]));
    assert_eq!(browser.eval("window.pyprobe.state.hits"), 1);
    search(&mut browser, "demo.py:100000");
    assert_eq!(browser.eval("window.pyprobe.state.hits"), 0);
    search(&mut browser, "");

    // Inverted, the widest frame under the root is the most sampled function.
    click_element(&mut browser, "#invert");
    assert_eq!(browser.eval("window.pyprobe.state.inverted"), true);
    let first = browser.eval(
        "(() => { const t = window.pyprobe.state.tree; return window.pyprobe.data.frames.name[t.frame[t.kids[0][0]]]; })()",
    );
    one_of(&tops, &first);

    // The sections a user scrolls to.
    for section in [
        "#gc table",
        "#imports table",
        "#audit table",
        "#sources table",
    ] {
        assert_eq!(
            browser.eval(&format!("!!document.querySelector('{section}')")),
            true,
            "{section}"
        );
    }
    // The heatmap's hottest line of demo.py is the line the most samples ran.
    let hottest = browser.eval(
        "(() => { const s = window.pyprobe.data.sources.find((s) => s.file.endsWith('demo.py'));
                  return s.lines.reduce((a, l) => (l[1] > a[1] ? l : a))[0]; })()",
    );
    let row = browser.eval(&format!(
        "document.querySelector('#sources tr[data-line=\"{hottest}\"] td.code').textContent"
    ));
    assert!(
        !row.as_str().unwrap().trim().is_empty(),
        "line {hottest} has its text"
    );
    browser.screenshot("html-report-sampled");
    browser.drain_events();
    assert!(browser.errors.is_empty(), "errors: {:?}", browser.errors);
}

/// A traced run on 3.9 (the ring engine): exact times and calls on the page
/// are the report's, and the thread filter narrows the graph to one thread.
#[test]
fn a_traced_html_report_has_the_reports_times_and_calls() {
    let Some(py) = python("3.9") else { return };
    let dir = tempfile::tempdir().unwrap();
    let recording = dir.path().join("demo-trace.pyprobe");
    record_demo(&py, &["--mode", "trace"], &recording);
    let report = report_json(recording.to_str().unwrap());
    let page = write_page(&recording);

    // The table and JSON go to standard output: -o names only the page.
    let refused = run_pyprobe(&[
        "report",
        recording.to_str().unwrap(),
        "--format",
        "json",
        "-o",
        page.to_str().unwrap(),
    ]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("-o and --force name the file"));

    let mut browser = Browser::launch(1400, 1000);
    browser.open(&page);
    assert!(browser.errors.is_empty(), "errors: {:?}", browser.errors);

    // The graph is the flame graph's stacks: the same total as `flame`'s
    // collapsed stacks (a GC pause a frame of its own there, out of the own
    // time of the function that triggered it).
    let folded = run_pyprobe(&[
        "flame",
        recording.to_str().unwrap(),
        "--format",
        "collapsed",
        "-o",
        "-",
    ]);
    let stacks_total: u64 = String::from_utf8_lossy(&folded.stdout)
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(
        browser.eval("window.pyprobe.state.tree.total[0]"),
        stacks_total
    );
    assert_eq!(browser.eval("window.pyprobe.data.measure"), "time");
    // fib starts no collection: its own time on the page is the report's.
    let fib = function_named(&report, "fib");
    let fib_own = browser.eval(
        "(() => { const t = window.pyprobe.state.tree; let s = 0;
                  for (let i = 1; i < t.frame.length; i++)
                    if (window.pyprobe.data.frames.name[t.frame[i]] === 'fib') s += t.self[i];
                  return s; })()",
    );
    assert_eq!(fib_own, fib["exclusive_ns"]);

    // The first hot spot: the most own time, its calls as the report counts them.
    let tops = tops_by(&report, &|f| f["exclusive_ns"].as_u64().unwrap());
    assert_first_hot_spot(&mut browser, &tops, 5, "calls");

    // One thread chosen: the graph is that thread's time.
    let thread = browser.eval(
        "(() => { const s = document.getElementById('thread'); return [...s.options].map((o) => o.value).filter((v) => v !== '0'); })()",
    );
    let first = thread[0].as_str().expect("a thread to choose").to_owned();
    browser.eval(&format!(
        "(() => {{ const s = document.getElementById('thread'); s.value = '{first}'; s.dispatchEvent(new Event('change')); }})()"
    ));
    let tid = report["threads"][0]["tid"].as_u64().unwrap();
    let threads = report["threads"].as_array().unwrap();
    if threads.len() == 1 {
        assert_eq!(
            browser.eval("window.pyprobe.state.tree.total[0]"),
            stacks_total
        );
    }
    assert!(browser
        .eval("document.getElementById('thread').selectedOptions[0].textContent")
        .as_str()
        .unwrap()
        .contains(&tid.to_string()));
    browser.screenshot("html-report-traced");
    browser.drain_events();
    assert!(browser.errors.is_empty(), "errors: {:?}", browser.errors);
}
