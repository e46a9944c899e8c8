use super::data::tree_columns;
use super::*;
use crate::analyze::folded::Folder;
use crate::analyze::replay::Replay;
use crate::recording::{Event, EventKind, FrameRef, Header, SampleState, StrId, WalkedFrame};

fn sampled(stacks: &[(&[u32], usize)]) -> Folded {
    fold(Folder::new(), stacks)
}

fn fold(mut folder: Folder, stacks: &[(&[u32], usize)]) -> Folded {
    let mut events = Vec::new();
    for (stack, times) in stacks {
        for _ in 0..*times {
            let frames = stack
                .iter()
                .map(|&f| WalkedFrame {
                    code: FrameRef {
                        file: StrId(0),
                        function: StrId(f),
                        line: 1,
                    },
                    line: 2,
                })
                .collect();
            events.push(Event {
                tid: 1,
                ts_ns: events.len() as u64,
                kind: EventKind::Sample {
                    frames,
                    state: SampleState::default(),
                },
            });
        }
    }
    let header = Header::default();
    let plan = crate::analyze::replay::plan_events(&header, &[], &events);
    let mut replay = Replay::new(&header, plan);
    let mut steps = Vec::new();
    for e in &events {
        steps.clear();
        let ts = replay.push(e, &mut steps);
        folder.push(e, ts, &steps, &replay);
    }
    folder.finish(replay, None)
}

fn strings() -> Vec<String> {
    ["/app/main.py", "f1", "f2", "f3", "f4", "f5"]
        .into_iter()
        .map(String::from)
        .collect()
}

#[test]
fn small_stacks_fold_into_their_callers_and_every_total_is_kept() {
    let folded = sampled(&[
        (&[1], 1000),
        (&[1, 2], 10),
        (&[1, 3], 2),
        (&[1, 3, 4], 1),
        (&[5], 1),
    ]);
    let strings = strings();
    let names = FrameNames::new(&strings, false);
    let all = |max| tree_columns(&folded, Measure::Samples, &names, max);

    let (frames, nodes, pruned) = all(usize::MAX);
    assert_eq!(pruned.stacks, 0);
    assert_eq!(nodes.parent.len(), 6, "the root and five stacks");
    assert_eq!(frames.name, ["f1", "f2", "f3", "f4", "f5"]);
    assert_eq!(nodes.value.iter().sum::<u64>(), 1014);

    // Room for the root and two stacks: f1 (1013) and f2 (10) stay; f3 and f4
    // fold into f1, f5 into the root.
    let (frames, nodes, pruned) = all(3);
    assert_eq!(nodes.parent.len(), 3);
    assert_eq!(pruned.stacks, 3);
    assert_eq!(pruned.min_total, 10);
    assert_eq!(frames.name, ["f1", "f2"]);
    assert_eq!(nodes.parent, [0, 0, 1]);
    assert_eq!(nodes.value, [1, 1003, 10]);
    assert!(nodes.calls.is_empty(), "a sampled tree has no calls");
}

#[test]
fn process_and_thread_frames_are_always_kept() {
    let folded = fold(Folder::new().by_thread(), &[(&[1], 50), (&[2], 1)]);
    let strings = strings();
    let names = FrameNames::new(&strings, false);
    // Room for three: the root, f1 and the thread frame, which is kept
    // whatever its total; f2 folds into the thread.
    let (frames, nodes, _) = tree_columns(&folded, Measure::Samples, &names, 3);
    assert_eq!(frames.name, ["thread 1", "f1"]);
    assert_eq!(nodes.parent, [0, 0, 1]);
    assert_eq!(nodes.value, [0, 1, 50]);
}

/// The text between `start` and the next `end` after it.
fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let from = text.find(start).expect("start") + start.len();
    let len = text[from..].find(end).expect("end");
    &text[from..from + len]
}

#[test]
fn hostile_names_and_titles_stay_text() {
    let folded = sampled(&[(&[1], 3)]);
    let strings = vec![
        "/app/main.py".to_string(),
        "</script><script>alert(1)</script>{{DATA}}".to_string(),
    ];
    let names = FrameNames::new(&strings, false);
    let page = HtmlPage {
        title: "pyprobe: <b>{{DATA}}{{STYLE}}",
        subtitle: "sub",
        report_json: r#"{"functions": [{"function": "</script>"}]}"#,
        sample_interval_ns: 1_000_000,
        sources: &[],
    };
    let mut out = Vec::new();
    write_html(&folded, Measure::Samples, &names, &page, &mut out).unwrap();
    let html = String::from_utf8(out).unwrap();
    assert_eq!(html.matches("</script>").count(), 2, "only the page's own");
    assert_eq!(html.matches("id=\"pyprobe-data\"").count(), 1);
    assert!(html.contains("<title>pyprobe: &lt;b&gt;{{DATA}}{{STYLE}}</title>"));
    let data: serde_json::Value =
        serde_json::from_str(between(&html, "id=\"pyprobe-data\">", "</script>")).unwrap();
    assert_eq!(
        data["frames"]["name"][0],
        "</script><script>alert(1)</script>{{DATA}}"
    );
    assert_eq!(data["report"]["functions"][0]["function"], "</script>");
    assert_eq!(data["measure"], "samples");
    assert_eq!(data["nodes"]["value"], serde_json::json!([0, 3]));
}
