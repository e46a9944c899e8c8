//! The data a report page carries: its stack tree (pruned to what a page can
//! draw), the frames it names, the report, and the source of the hottest files.

use std::collections::HashMap;

use serde::Serialize;

use super::HtmlPage;
use crate::analyze::folded::{FoldFrame, Folded, Measure, NodeId, StackTree};
use crate::analyze::line_counts::LineCount;
use crate::output::names::{origin, thread_name, FrameNames, Origin};

/// Most stacks a page carries: past this, the smallest are folded into their
/// callers (a browser draws a few hundred thousand boxes slowly).
pub const MAX_NODES: usize = 100_000;

/// One source file of the per-line heatmap.
#[derive(Debug, Clone, Serialize)]
pub struct SourceFile {
    /// Its path as the recording names it.
    pub file: String,
    /// Its text, line by line, read from disk when the page was written;
    /// `None` when it could not be read.
    pub text: Option<Vec<String>>,
    /// Why the text is missing.
    pub missing: Option<String>,
    /// `[line, own samples, total samples, line hits]`, in line order.
    pub lines: Vec<[u64; 4]>,
}

impl SourceFile {
    /// A file's counts as [`LineCounts::of_file`](crate::analyze::line_counts::LineCounts::of_file)
    /// gives them, and its text (or why there is none).
    pub fn new(
        file: String,
        counts: &[(u32, LineCount)],
        text: Result<Vec<String>, String>,
    ) -> Self {
        let lines = counts
            .iter()
            .map(|(line, c)| [u64::from(*line), c.own, c.total, c.hits])
            .collect();
        let (text, missing) = match text {
            Ok(t) => (Some(t), None),
            Err(why) => (None, Some(why)),
        };
        SourceFile {
            file,
            text,
            missing,
            lines,
        }
    }
}

/// What each kind of frame is, for colour and for the thread filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Kind {
    /// Python code of the program itself.
    App,
    /// The standard library (and `<frozen ...>`).
    Stdlib,
    /// Installed packages.
    Package,
    /// A native (C) frame (`--native`).
    Native,
    /// A garbage collection.
    Gc,
    Process,
    Thread,
}

/// The distinct frames of the tree, column by column.
#[derive(Debug, Default, Serialize)]
pub(super) struct Frames {
    pub(super) name: Vec<String>,
    pub(super) file: Vec<String>,
    pub(super) line: Vec<u32>,
    pub(super) kind: Vec<Kind>,
}

/// The tree, column by column: node 0 is the root; a parent comes before its
/// children.
#[derive(Debug, Default, Serialize)]
pub(super) struct Nodes {
    pub(super) parent: Vec<u32>,
    pub(super) frame: Vec<u32>,
    /// Own value in the page's measure.
    pub(super) value: Vec<u64>,
    /// Own finished calls (traced recordings; empty otherwise).
    pub(super) calls: Vec<u64>,
}

/// What the page says about stacks left out.
#[derive(Debug, Default, Serialize)]
pub(super) struct Pruned {
    /// Stacks folded into their callers.
    pub(super) stacks: u64,
    /// Smallest total kept.
    pub(super) min_total: u64,
}

/// Everything the page's script reads.
#[derive(Debug, Serialize)]
pub(super) struct PageData<'a> {
    title: &'a str,
    subtitle: &'a str,
    /// `time` (ns), `samples` or `calls`.
    measure: &'static str,
    sample_interval_ns: u64,
    frames: Frames,
    nodes: Nodes,
    pruned: Pruned,
    /// The report's JSON document (`pyprobe report --format json`).
    report: serde_json::Value,
    sources: &'a [SourceFile],
}

fn measure_name(measure: Measure) -> &'static str {
    match measure {
        Measure::Time => "time",
        Measure::Calls => "calls",
        Measure::Samples => "samples",
    }
}

/// The smallest total a stack needs to be kept so that at most `max` are.
fn min_total_for(totals: &[u64], max: usize) -> u64 {
    if totals.len() <= max {
        return 0;
    }
    if max == 0 {
        return u64::MAX;
    }
    let mut sorted: Vec<u64> = totals.to_vec();
    let cut = sorted.len() - max;
    let (below, &mut nth, _) = sorted.select_nth_unstable(cut);
    // Ties at the cut are all dropped: at most `max` kept.
    if below.contains(&nth) {
        nth.saturating_add(1)
    } else {
        nth
    }
}

struct FrameTable<'n, 'a> {
    names: &'n FrameNames<'a>,
    index: HashMap<FoldFrame, u32>,
    frames: Frames,
}

impl FrameTable<'_, '_> {
    fn id(&mut self, frame: FoldFrame) -> u32 {
        if let Some(&id) = self.index.get(&frame) {
            return id;
        }
        let id = self.frames.name.len() as u32;
        let names = self.names;
        let (name, file, line, kind) = match frame {
            FoldFrame::Python(code) | FoldFrame::PythonLine { code, .. } => {
                let file = names.string(code.file).into_owned();
                let kind = if code.line == 0 {
                    Kind::Native
                } else {
                    match origin(&file) {
                        Origin::App => Kind::App,
                        Origin::Stdlib => Kind::Stdlib,
                        Origin::ThirdParty => Kind::Package,
                        Origin::Process => Kind::Process,
                    }
                };
                let line = match frame {
                    FoldFrame::PythonLine { line, .. } => line,
                    _ => code.line,
                };
                (names.function(&code).into_owned(), file, line, kind)
            }
            FoldFrame::Gc { generation } => {
                (format!("[gc gen {generation}]"), String::new(), 0, Kind::Gc)
            }
            FoldFrame::Process { pid, command } => {
                (names.process(pid, command), String::new(), 0, Kind::Process)
            }
            FoldFrame::Thread { tid, pid } => {
                (thread_name(tid, pid), String::new(), 0, Kind::Thread)
            }
        };
        self.frames.name.push(name);
        self.frames.file.push(file);
        self.frames.line.push(line);
        self.frames.kind.push(kind);
        self.index.insert(frame, id);
        id
    }
}

/// The page's tree and frames from `folded`: every stack whose total reaches
/// the cut [`MAX_NODES`] sets (process and thread frames always), the others'
/// values added to their nearest kept caller, so every total is kept.
pub(super) fn tree_columns(
    folded: &Folded,
    measure: Measure,
    names: &FrameNames<'_>,
    max_nodes: usize,
) -> (Frames, Nodes, Pruned) {
    let tree: &StackTree = &folded.tree;
    let totals = folded.subtree_totals(measure);
    let min_total = min_total_for(&totals, max_nodes);
    let traced = measure != Measure::Samples;
    let mut table = FrameTable {
        names,
        index: HashMap::new(),
        frames: Frames::default(),
    };
    let mut nodes = Nodes::default();
    let mut pruned = Pruned {
        stacks: 0,
        min_total,
    };
    // Per tree node: the page node standing for it (itself, or the caller it
    // was folded into), and whether it is its own.
    let mut page_node: Vec<u32> = Vec::with_capacity(tree.len());
    let mut kept: Vec<bool> = Vec::with_capacity(tree.len());
    page_node.push(0);
    kept.push(true);
    nodes.parent.push(0);
    nodes.frame.push(u32::MAX);
    nodes.value.push(folded.value(StackTree::ROOT, measure));
    if traced {
        nodes
            .calls
            .push(folded.value(StackTree::ROOT, Measure::Calls));
    }
    for n in 1..tree.len() as NodeId {
        let parent = tree.parent(n) as usize;
        let parent_page = page_node[parent];
        let frame = tree.frame(n);
        let always = matches!(
            frame,
            Some(FoldFrame::Process { .. } | FoldFrame::Thread { .. })
        );
        // A stack folded away takes its callees with it (their totals are
        // smaller still).
        let keep = frame.filter(|_| kept[parent] && (always || totals[n as usize] >= min_total));
        let own = folded.value(n, measure);
        match keep {
            Some(f) => {
                let id = nodes.parent.len() as u32;
                nodes.parent.push(parent_page);
                nodes.frame.push(table.id(f));
                nodes.value.push(own);
                if traced {
                    nodes.calls.push(folded.value(n, Measure::Calls));
                }
                page_node.push(id);
                kept.push(true);
            }
            None => {
                pruned.stacks += 1;
                let p = parent_page as usize;
                nodes.value[p] = nodes.value[p].saturating_add(own);
                if traced {
                    nodes.calls[p] = nodes.calls[p].saturating_add(folded.value(n, Measure::Calls));
                }
                page_node.push(parent_page);
                kept.push(false);
            }
        }
    }
    (table.frames, nodes, pruned)
}

impl<'a> PageData<'a> {
    pub(super) fn new(
        page: &HtmlPage<'a>,
        folded: &Folded,
        measure: Measure,
        names: &FrameNames<'_>,
        report: serde_json::Value,
    ) -> Self {
        let (frames, nodes, pruned) = tree_columns(folded, measure, names, MAX_NODES);
        PageData {
            title: page.title,
            subtitle: page.subtitle,
            measure: measure_name(measure),
            sample_interval_ns: page.sample_interval_ns,
            frames,
            nodes,
            pruned,
            report,
            sources: page.sources,
        }
    }
}
