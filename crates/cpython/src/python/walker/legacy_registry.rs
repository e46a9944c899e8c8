//! Where asyncio keeps its tasks before 3.14, which keeps them in lists the
//! interpreter publishes: in objects of its own C module, which `asyncio.tasks`
//! imports by name.
//!
//! * `_all_tasks` (3.7 to 3.11) and `_scheduled_tasks` (3.12, 3.13): a
//!   `weakref.WeakSet` of every task made and not yet collected, whose first
//!   attribute, `data`, is a set of weak references to them;
//! * `_eager_tasks` (3.12, 3.13): a set of the tasks started eagerly;
//! * `_current_tasks`: a dict of each running loop's task.
//!
//! They are found once through `sys.modules` (the interpreter's `modules`, an
//! offset the offsets file gives) and kept while they are what they were: a set
//! is a set, a dict a dict. Looked for again at most every 20 ms until found
//! (asyncio is imported some time after a program starts).

use super::dicts::{dict_items, DictKeys};
use super::legacy_tasks::LegacyTasks;
use super::objects::{plausible_pointer, read_u64};
use super::tasks::set_keys;
use super::Walker;

/// `PyModuleObject.md_dict`: the first field past the object's head (the
/// structure is private up to 3.10).
const MODULE_DICT: u64 = 16;
/// `PyWeakReference.wr_object` (`None` once the referent died).
const WEAKREF_OBJECT: u64 = 16;
/// `PySetObject.mask` and `table`.
const SET_MASK: u64 = 32;
const SET_TABLE: u64 = 40;
/// Most entries of a registry's set read: a set of 100,000 tasks has 262,144
/// (4 MiB).
const MAX_SET_SLOTS: u64 = 1 << 18;
/// How long before looking for the registry again (a look that finds no
/// `asyncio.tasks` costs a handful of reads).
const LOOK_AGAIN: std::time::Duration = std::time::Duration::from_millis(20);
/// Longest module name compared.
const MAX_KEY_CHARS: usize = 64;

/// A member of one of the registry's sets: a weak reference to a task, or a
/// task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Member {
    pub(super) at: u64,
    pub(super) weak: bool,
}

/// asyncio's registry of tasks in one process (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LegacyRegistry {
    /// The sets the tasks are in, each with whether it holds weak references to
    /// them (a `WeakSet`'s `data`) or the tasks themselves (`_eager_tasks`).
    sets: Vec<(u64, bool)>,
    /// `_current_tasks`.
    current: Option<u64>,
}

impl Walker {
    /// asyncio's registry of tasks, found now or before and still as found;
    /// `None` before asyncio is imported, on 3.14+ (which publish their own
    /// lists) and where this version's offsets do not say where `sys.modules` is.
    pub(super) fn legacy_registry(&mut self) -> Option<LegacyRegistry> {
        if let Some(known) = &self.legacy_registry {
            if self.registry_holds(known) {
                return Some(known.clone());
            }
            self.legacy_registry = None;
        }
        let due = self
            .legacy_registry_looked_for
            .is_none_or(|at| at.elapsed() >= LOOK_AGAIN);
        if !due {
            return None;
        }
        self.legacy_registry_looked_for = Some(std::time::Instant::now());
        self.legacy_registry = self.find_legacy_registry();
        self.legacy_registry.clone()
    }

    /// Whether the registry's objects are still a set each and a dict.
    fn registry_holds(&self, registry: &LegacyRegistry) -> bool {
        let is = |at: u64, name: &str| self.short_type_name(at).as_deref() == Some(name);
        registry.sets.iter().all(|&(set, _)| is(set, "set"))
            && registry.current.is_none_or(|d| is(d, "dict"))
    }

    fn find_legacy_registry(&mut self) -> Option<LegacyRegistry> {
        // Only where the C task's layout is known.
        self.legacy_tasks?;
        let keys = DictKeys::of(self.version.minor)?;
        let modules_at = self.reader.layout.interp_modules?;
        let interp = self.main_interpreter()?;
        let modules = read_u64(&self.reader.mem, interp.checked_add(modules_at)?).ok()?;
        let module = self.dict_lookup(keys, modules, "asyncio.tasks")?;
        if self.short_type_name(module).as_deref() != Some("module") {
            return None;
        }
        let globals = read_u64(&self.reader.mem, module + MODULE_DICT).ok()?;
        let mut registry = LegacyRegistry::default();
        for (key, value) in dict_items(&self.reader.mem, keys, globals) {
            let Some(name) = self.short_str(key) else {
                continue;
            };
            let kind = self.short_type_name(value);
            match (name.as_str(), kind.as_deref()) {
                ("_all_tasks" | "_scheduled_tasks", Some("WeakSet")) => {
                    registry
                        .sets
                        .extend(self.weakset_data(value).map(|d| (d, true)));
                }
                ("_eager_tasks", Some("set")) => registry.sets.push((value, false)),
                ("_current_tasks", Some("dict")) => registry.current = Some(value),
                _ => {}
            }
        }
        (!registry.sets.is_empty()).then_some(registry)
    }

    /// The value of the dict at `dict` whose key is the ASCII str `name`: the
    /// keys' lengths read in one go, the text of those as long as `name` only.
    fn dict_lookup(&self, keys: DictKeys, dict: u64, name: &str) -> Option<u64> {
        let items = dict_items(&self.reader.mem, keys, dict);
        let length = self.reader.layout.unicode.length;
        let at: Vec<u64> = items.iter().map(|&(key, _)| key + length).collect();
        let mut lengths = Vec::new();
        self.reader.mem.read_words(&at, &mut lengths);
        items
            .into_iter()
            .zip(lengths)
            .filter(|(_, len)| *len == Some(name.len() as u64))
            .find(|&((key, _), _)| self.short_str(key).as_deref() == Some(name))
            .map(|((_, value), _)| value)
    }

    /// The text of the str at `addr`, if it is one of at most
    /// [`MAX_KEY_CHARS`] characters.
    fn short_str(&self, addr: u64) -> Option<String> {
        let text = self.read_str(addr)?;
        (text.chars().count() <= MAX_KEY_CHARS).then(|| text.to_string())
    }

    /// The `data` set of the `WeakSet` at `weakset`.
    fn weakset_data(&self, weakset: u64) -> Option<u64> {
        let [data] = self.attributes(weakset, ["data"]);
        data.filter(|&d| self.short_type_name(d).as_deref() == Some("set"))
    }

    /// Every task in the registry's sets, with its coroutine, in address order:
    /// those still running a coroutine (a finished task has dropped its own), at
    /// most `max`.
    pub(super) fn registered_tasks(
        &self,
        legacy: LegacyTasks,
        registry: &LegacyRegistry,
        max: usize,
    ) -> Vec<(u64, u64)> {
        let mem = &self.reader.mem;
        let members = self.registry_members(registry);
        let weak: Vec<u64> = members
            .iter()
            .filter(|m| m.weak)
            .map(|m| m.at + WEAKREF_OBJECT)
            .collect();
        let mut words = Vec::new();
        mem.read_words(&weak, &mut words);
        let mut tasks: Vec<u64> = members
            .iter()
            .filter(|m| !m.weak)
            .map(|m| m.at)
            .chain(words.into_iter().flatten())
            .collect();
        tasks.retain(|&t| plausible_pointer(t));
        tasks.sort_unstable();
        tasks.dedup();
        // Each C task's coroutine, then each coroutine's type, in one read each;
        // a pure-Python task's from its attributes.
        let plain = self.plain_instances(&tasks);
        let at: Vec<u64> = tasks.iter().map(|t| t + legacy.task_coro).collect();
        let mut coros = Vec::new();
        mem.read_words(&at, &mut coros);
        let coros: Vec<u64> = coros
            .into_iter()
            .zip(&tasks)
            .zip(plain)
            .map(|((c, &task), plain)| match plain {
                true => self.plain_py_task(task).map_or(0, |t| t.coro),
                false => c.unwrap_or(0),
            })
            .collect();
        let kinds = self.short_type_names(&coros);
        tasks
            .into_iter()
            .zip(coros)
            .zip(kinds)
            .filter(|(_, kind)| kind.as_deref() == Some("coroutine"))
            .map(|(pair, _)| pair)
            .take(max)
            .collect()
    }

    /// The members of the registry's sets, in address order, one read a set: the
    /// weak references to tasks, and the tasks of `_eager_tasks`.
    pub(super) fn registry_members(&self, registry: &LegacyRegistry) -> Vec<Member> {
        let mut members: Vec<Member> = registry
            .sets
            .iter()
            .flat_map(|&(set, weak)| {
                set_keys(&self.reader.mem, set, (SET_TABLE, SET_MASK), MAX_SET_SLOTS)
                    .into_iter()
                    .map(move |at| Member { at, weak })
            })
            .collect();
        members.sort_unstable_by_key(|m| m.at);
        members
    }

    /// The task a member stands for, with its coroutine: a weak reference's
    /// referent (none once it died), a task still running a coroutine.
    pub(super) fn member_task(&self, legacy: LegacyTasks, member: Member) -> Option<(u64, u64)> {
        let task = if member.weak {
            read_u64(&self.reader.mem, member.at + WEAKREF_OBJECT).ok()?
        } else {
            member.at
        };
        if !plausible_pointer(task) {
            return None;
        }
        Some((task, self.task_coroutine(legacy, task)?))
    }

    /// The tasks the running loops run now (`_current_tasks`' values).
    pub(super) fn current_tasks(&self, registry: &LegacyRegistry) -> Vec<u64> {
        let Some(keys) = DictKeys::of(self.version.minor) else {
            return Vec::new();
        };
        registry
            .current
            .map(|d| dict_items(&self.reader.mem, keys, d))
            .unwrap_or_default()
            .into_iter()
            .map(|(_, task)| task)
            .collect()
    }
}
