//! Pairs `import_start`/`import_done` per thread. Imports nest (a module's body
//! imports others), so each thread keeps a stack; the enclosing import is the
//! importer.

use std::collections::HashMap;

use crate::recording::StrId;

/// Deepest import nesting tracked per thread.
const MAX_IMPORT_DEPTH: usize = 256;

struct OpenImport {
    module: StrId,
    start_ns: u64,
    child_ns: u64,
}

/// Per-module accumulator, strings unresolved.
#[derive(Default, Clone)]
pub(crate) struct ImportAcc {
    pub found: bool,
    pub total_ns: u64,
    pub self_ns: u64,
    pub count: u64,
    pub importer: Option<StrId>,
}

#[derive(Default)]
pub(crate) struct ImportTracker {
    stacks: HashMap<u32, Vec<OpenImport>>,
    pub(crate) modules: HashMap<StrId, ImportAcc>,
    pub(crate) unpaired: u64,
}

impl ImportTracker {
    pub(crate) fn start(&mut self, tid: u32, module: StrId, ts: u64) {
        let stack = self.stacks.entry(tid).or_default();
        if let Some(parent) = stack.last() {
            let acc = self.modules.entry(module).or_default();
            if acc.importer.is_none() && parent.module != module {
                acc.importer = Some(parent.module);
            }
        }
        if stack.len() >= MAX_IMPORT_DEPTH {
            self.unpaired += 1;
            return;
        }
        stack.push(OpenImport {
            module,
            start_ns: ts,
            child_ns: 0,
        });
    }

    pub(crate) fn done(&mut self, tid: u32, module: StrId, found: bool, ts: u64) {
        let stack = self.stacks.entry(tid).or_default();
        let open = match stack.iter().rposition(|o| o.module == module) {
            Some(i) => {
                // Starts above it never finished.
                self.unpaired += (stack.len() - i - 1) as u64;
                stack.truncate(i + 1);
                stack.pop()
            }
            None => {
                self.unpaired += 1;
                None
            }
        };
        let timed = open.map(|open| {
            let total = ts.saturating_sub(open.start_ns);
            if let Some(parent) = stack.last_mut() {
                parent.child_ns = parent.child_ns.saturating_add(total);
            }
            (total, total.saturating_sub(open.child_ns))
        });
        let acc = self.modules.entry(module).or_default();
        acc.count += 1;
        acc.found |= found;
        if let Some((total, own)) = timed {
            acc.total_ns = acc.total_ns.saturating_add(total);
            acc.self_ns = acc.self_ns.saturating_add(own);
        }
    }

    pub(crate) fn thread_exit(&mut self, tid: u32) {
        if let Some(stack) = self.stacks.remove(&tid) {
            self.unpaired += stack.len() as u64;
        }
    }

    /// Imports still open at the end count as unpaired.
    pub fn finish(self) -> (HashMap<StrId, ImportAcc>, u64) {
        let open: usize = self.stacks.values().map(Vec::len).sum();
        (self.modules, self.unpaired + open as u64)
    }
}
