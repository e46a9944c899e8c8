'use strict';
// pyprobe's report page: draws the data document above it. No network, no
// library: a flame graph of absolutely placed boxes and a few tables.
(function () {
  const D = JSON.parse(document.getElementById('pyprobe-data').textContent);
  const R = D.report || {};
  const F = D.frames;
  const N = D.nodes;
  const SOURCES = new Map((D.sources || []).map((s) => [s.file, s]));
  const ROW = 18;
  const MAX_BOXES = 20000;

  // ---- formatting -------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  }
  function count(n) { return Math.round(n).toLocaleString('en-US'); }
  function ns(t) {
    if (t >= 1e9) return (t / 1e9).toFixed(t >= 1e11 ? 0 : 2) + ' s';
    if (t >= 1e6) return (t / 1e6).toFixed(t >= 1e8 ? 0 : 1) + ' ms';
    if (t >= 1e3) return (t / 1e3).toFixed(t >= 1e5 ? 0 : 1) + ' µs';
    return Math.round(t) + ' ns';
  }
  function pct(part, whole) {
    return whole > 0 ? (100 * part / whole).toFixed(1) + ' %' : '–';
  }
  // As the text report shortens: after site-packages/, after lib/pythonX.Y/,
  // else the last two components.
  function shortPath(file) {
    if (!file || file.startsWith('<')) return file || '';
    for (const m of ['/site-packages/', '/dist-packages/']) {
      const i = file.lastIndexOf(m);
      if (i >= 0) return file.slice(i + m.length);
    }
    const std = /\/(?:lib|lib64|Lib)\/python\d[\d.]*\/(.+)$/.exec(file);
    if (std) return std[1];
    const parts = file.split('/');
    return parts.length > 2 ? parts.slice(-2).join('/') : file;
  }
  function where(file, line) {
    if (!file) return '';
    return line ? shortPath(file) + ':' + line : shortPath(file);
  }
  const MEASURE = D.measure;
  function value(v) {
    if (MEASURE === 'time') return ns(v);
    if (MEASURE === 'samples') return count(v) + (v === 1 ? ' sample' : ' samples');
    return count(v) + (v === 1 ? ' call' : ' calls');
  }
  function hue(name) {
    let h = 0;
    for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) % 997;
    return h % 50;
  }

  // ---- trees --------------------------------------------------------------
  // A tree interns (parent, frame) pairs; node 0 is the root (frame -1).
  function newTree() {
    return { frame: [-1], parent: [-1], self: [0], calls: [0], index: new Map() };
  }
  const FRAME_COUNT = F.name.length + 1;
  function child(t, parent, frame) {
    const key = parent * FRAME_COUNT + frame;
    let id = t.index.get(key);
    if (id === undefined) {
      id = t.frame.length;
      t.index.set(key, id);
      t.frame.push(frame);
      t.parent.push(parent);
      t.self.push(0);
      t.calls.push(0);
    }
    return id;
  }
  // Totals (own plus callees') and children, heaviest first.
  function finish(t) {
    const n = t.frame.length;
    t.total = Float64Array.from(t.self);
    for (let i = n - 1; i > 0; i--) t.total[t.parent[i]] += t.total[i];
    t.kids = Array.from({ length: n }, () => []);
    for (let i = 1; i < n; i++) t.kids[t.parent[i]].push(i);
    for (const k of t.kids) if (k.length > 1) k.sort((a, b) => t.total[b] - t.total[a]);
    return t;
  }
  const isThreadish = (f) => f >= 0 && (F.kind[f] === 'thread' || F.kind[f] === 'process');
  // The stacks under base node `sel` (0: all), thread and process frames
  // left out so that threads merge.
  function derive(sel) {
    const t = newTree();
    const n = N.parent.length;
    const map = new Int32Array(n).fill(-1);
    map[sel] = 0;
    // A parent comes before its children: one pass maps every node under `sel`.
    for (let i = 1; i < n; i++) {
      if (i === sel) continue;
      const p = N.parent[i];
      if (map[p] < 0) continue;
      const f = N.frame[i];
      map[i] = isThreadish(f) ? map[p] : child(t, map[p], f);
    }
    for (let i = 0; i < n; i++) {
      if (map[i] < 0) continue;
      t.self[map[i]] += N.value[i];
      if (N.calls.length) t.calls[map[i]] += N.calls[i];
    }
    return finish(t);
  }
  // Each stack read from its innermost frame out: a function's callers below it.
  function invert(t) {
    const v = newTree();
    for (let i = 1; i < t.frame.length; i++) {
      if (!t.self[i]) continue;
      let node = 0;
      for (let j = i; j !== 0; j = t.parent[j]) node = child(v, node, t.frame[j]);
      v.self[node] += t.self[i];
    }
    return finish(v);
  }

  // ---- the flame graph ------------------------------------------------------
  const flame = document.getElementById('flame');
  const tooltip = document.getElementById('tooltip');
  const search = document.getElementById('search');
  const threadSelect = document.getElementById('thread');
  const invertBox = document.getElementById('invert');
  const matches = document.getElementById('matches');
  const state = { sel: 0, inverted: false, zoom: 0, query: '', tree: null, boxes: 0, hits: 0, matched: 0 };
  window.pyprobe = { data: D, state };

  document.getElementById('width-means').textContent =
    MEASURE === 'time' ? 'time spent in the function itself (callees stacked above it)'
      : MEASURE === 'samples' ? 'samples (each one stack seen at a sampling tick)'
        : 'finished calls';

  function frameName(f) { return f < 0 ? 'all' : F.name[f]; }
  // A module's code is named by its file: every module body is `<module>`.
  function label(f) {
    if (f < 0) return 'all';
    return F.name[f] === '<module>' && F.file[f] ? '<module> ' + shortPath(F.file[f]) : F.name[f];
  }
  function matcher(q) {
    q = q.trim();
    if (!q) return null;
    const fl = /^(.*\S):(\d+)$/.exec(q);
    if (fl) {
      const file = fl[1].toLowerCase();
      const line = Number(fl[2]);
      return (f) => f >= 0 && F.line[f] === line && fileMatches(F.file[f], file);
    }
    const low = q.toLowerCase();
    return (f) => f >= 0 && (F.name[f].toLowerCase().includes(low) || F.file[f].toLowerCase().includes(low));
  }
  function fileMatches(file, wanted) {
    const low = file.toLowerCase();
    return low === wanted || low.endsWith('/' + wanted) || shortPath(file).toLowerCase() === wanted;
  }

  function rebuild() {
    const base = derive(state.sel);
    state.tree = state.inverted ? invert(base) : base;
    state.zoom = 0;
    render();
  }

  function render() {
    const t = state.tree;
    const width = flame.clientWidth || 1000;
    const match = matcher(state.query);
    const frag = document.createDocumentFragment();
    let boxes = 0;
    let maxDepth = 0;
    function box(node, x, w, depth, extra) {
      const f = t.frame[node];
      // asyncio's markers (`[task NAME]`, `[awaiting Task]`) come from `<asyncio>`.
      const kind = f < 0 ? 'root' : F.file[f] === '<asyncio>' ? 'task' : F.kind[f];
      const b = document.createElement('div');
      b.className = 'f k-' + kind + (extra || '') + (match && match(f) ? ' hit' : '');
      b.style.left = x + 'px';
      b.style.width = Math.max(w - 1, 1) + 'px';
      b.style.top = depth * ROW + 'px';
      b.style.setProperty('--h', hue(frameName(f)));
      b.dataset.node = node;
      if (w > 24) b.textContent = f < 0 ? 'all (' + value(t.total[0]) + ')' : label(f);
      frag.append(b);
      boxes++;
      if (depth > maxDepth) maxDepth = depth;
    }
    // The zoomed frame's callers, full width, then the frame and what it calls.
    const path = [];
    for (let j = state.zoom; j !== 0; j = t.parent[j]) path.push(j);
    path.push(0);
    path.reverse();
    path.forEach((node, depth) => box(node, 0, width, depth, node === state.zoom ? '' : ' anc'));
    const top = path.length - 1;
    const scale = t.total[state.zoom] > 0 ? width / t.total[state.zoom] : 0;
    const stack = [[state.zoom, 0, top]];
    while (stack.length && boxes < MAX_BOXES) {
      const [node, x0, depth] = stack.pop();
      let x = x0;
      for (const k of t.kids[node]) {
        const w = t.total[k] * scale;
        if (w < 0.5) break;
        box(k, x, w, depth + 1, '');
        stack.push([k, x, depth + 1]);
        x += w;
        if (boxes >= MAX_BOXES) break;
      }
    }
    flame.replaceChildren(frag);
    flame.style.height = (maxDepth + 1) * ROW + 4 + 'px';
    flame.classList.toggle('searching', !!match);
    state.boxes = boxes;
    showMatches(match);
  }

  // The share of the total the matching frames hold (a match under another
  // counted once).
  function showMatches(match) {
    if (!match) {
      matches.textContent = '';
      state.hits = 0;
      state.matched = 0;
      return;
    }
    const t = state.tree;
    const n = t.frame.length;
    const under = new Uint8Array(n);
    let share = 0;
    let functions = new Set();
    for (let i = 1; i < n; i++) {
      const m = match(t.frame[i]);
      if (m) functions.add(t.frame[i]);
      if (m && !under[t.parent[i]]) share += t.total[i];
      under[i] = under[t.parent[i]] || (m ? 1 : 0);
    }
    state.hits = functions.size;
    state.matched = share;
    matches.textContent = functions.size
      ? functions.size + (functions.size === 1 ? ' function matches: ' : ' functions match: ') + pct(share, t.total[0]) + ' of the total'
      : 'nothing matches';
  }

  function sourceLine(file, line) {
    const s = SOURCES.get(file);
    if (!s || !s.text || !line || line > s.text.length) return null;
    return s.text[line - 1].trim();
  }
  function describe(node) {
    const t = state.tree;
    const f = t.frame[node];
    const parts = [el('b', { text: label(f) })];
    if (f >= 0 && F.file[f]) parts.push(el('div', { text: where(F.file[f], F.line[f]) }));
    const total = t.total[0];
    parts.push(el('div', { text: 'total ' + value(t.total[node]) + ' (' + pct(t.total[node], total) + ')' }));
    parts.push(el('div', { text: 'own ' + value(t.self[node]) + ' (' + pct(t.self[node], total) + ')' }));
    if (!state.inverted && N.calls.length && MEASURE !== 'calls') parts.push(el('div', { text: count(t.calls[node]) + ' finished calls' }));
    const code = f >= 0 ? sourceLine(F.file[f], F.line[f]) : null;
    if (code) parts.push(el('code', { text: code }));
    return parts;
  }
  flame.addEventListener('mousemove', (e) => {
    const b = e.target.closest('.f');
    if (!b) { tooltip.hidden = true; return; }
    tooltip.replaceChildren(...describe(Number(b.dataset.node)));
    tooltip.hidden = false;
    const x = Math.min(e.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
    tooltip.style.left = Math.max(x, 4) + 'px';
    tooltip.style.top = e.clientY + 16 + 'px';
  });
  flame.addEventListener('mouseleave', () => { tooltip.hidden = true; });
  flame.addEventListener('click', (e) => {
    const b = e.target.closest('.f');
    if (!b) return;
    state.zoom = Number(b.dataset.node);
    render();
  });
  document.getElementById('reset').addEventListener('click', () => { state.zoom = 0; render(); });
  search.addEventListener('input', () => { state.query = search.value; render(); });
  invertBox.addEventListener('change', () => { state.inverted = invertBox.checked; rebuild(); });
  threadSelect.addEventListener('change', () => { state.sel = Number(threadSelect.value); rebuild(); });
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape') { state.zoom = state.tree.parent[state.zoom] > 0 ? state.tree.parent[state.zoom] : 0; render(); }
    if (e.key === '/' && document.activeElement !== search) { e.preventDefault(); search.focus(); }
  });
  window.addEventListener('resize', () => render());

  // The thread filter: every process and thread frame of the base tree.
  function fillThreads() {
    const totals = Float64Array.from(N.value);
    for (let i = N.parent.length - 1; i > 0; i--) totals[N.parent[i]] += totals[i];
    threadSelect.append(el('option', { value: '0', text: 'All threads (merged)' }));
    let shown = 0;
    for (let i = 1; i < N.parent.length; i++) {
      const f = N.frame[i];
      if (!isThreadish(f)) continue;
      const indent = N.parent[i] !== 0 && isThreadish(N.frame[N.parent[i]]) ? '\u00a0\u00a0' : '';
      threadSelect.append(el('option', { value: String(i), text: indent + F.name[f] + ' — ' + pct(totals[i], totals[0]) }));
      shown++;
    }
    if (!shown) threadSelect.hidden = true;
  }

  // ---- tables ---------------------------------------------------------------
  // A table of `rows` (arrays of cells), the first `limit` shown and a button
  // for the rest.
  function table(headers, rows, limit) {
    const t = el('table');
    const head = el('tr');
    for (const h of headers) head.append(el('th', { class: h.n ? 'n' : '', text: h.t }));
    t.append(el('thead', {}, head));
    const body = el('tbody');
    t.append(body);
    function fill(n) {
      body.replaceChildren();
      for (const r of rows.slice(0, n)) {
        const tr = el('tr');
        r.forEach((c, i) => {
          const td = el('td', { class: headers[i].n ? 'n' : headers[i].path ? 'path' : '' });
          if (c instanceof Node) td.append(c); else td.textContent = c;
          tr.append(td);
        });
        body.append(tr);
      }
      if (rows.length > n) {
        const more = el('button', { class: 'more', type: 'button', text: '… ' + count(rows.length - n) + ' more' });
        more.addEventListener('click', () => fill(rows.length));
        body.append(el('tr', {}, el('td', { colspan: String(headers.length) }, more)));
      }
    }
    fill(limit);
    return t;
  }
  function note(text) { return el('p', { class: 'note', text }); }
  function bar(part, whole) {
    const b = el('span', { class: 'bar' });
    b.style.width = (whole > 0 ? Math.round(60 * part / whole) : 0) + 'px';
    return b;
  }
  function cell(part, whole, text) { return el('span', {}, bar(part, whole), text); }

  const sampled = MEASURE === 'samples';
  function fnName(f) { return f.qualname || f.function || '?'; }

  function hotspots() {
    const sec = document.getElementById('hotspots');
    const fns = (R.functions || []).slice();
    if (!fns.length) { sec.append(note('No function was recorded.')); return; }
    if (sampled) {
      // The report counts a function's own samples, and its total as time:
      // total samples × the interval.
      const every = D.sample_interval_ns || R.sample_interval_ns || 0;
      const own = (f) => f.samples;
      const total = (f) => every ? Math.round(f.inclusive_ns / every) : 0;
      const all = R.sample_filter && R.sample_filter.kept ? R.sample_filter.kept : fns.reduce((a, f) => a + own(f), 0);
      fns.sort((a, b) => own(b) - own(a) || total(b) - total(a));
      const rows = fns.map((f) => [fnName(f), where(f.file, f.line),
        cell(own(f), all, count(own(f))), pct(own(f), all), count(total(f)), pct(total(f), all)]);
      sec.append(table([{ t: 'Function' }, { t: 'File', path: 1 }, { t: 'Own samples', n: 1 }, { t: 'Own', n: 1 },
        { t: 'Total samples', n: 1 }, { t: 'Total', n: 1 }], rows, 25));
      return;
    }
    const total = fns.reduce((a, f) => a + f.exclusive_ns, 0);
    const timed = total > 0;
    fns.sort((a, b) => timed ? b.exclusive_ns - a.exclusive_ns : (b.calls || 0) - (a.calls || 0));
    const rows = fns.map((f) => [fnName(f), where(f.file, f.line),
      cell(f.exclusive_ns, total, ns(f.exclusive_ns)), pct(f.exclusive_ns, total),
      ns(f.inclusive_ns), f.calls == null ? '–' : count(f.calls), f.resumes ? count(f.resumes) : '']);
    sec.append(table([{ t: 'Function' }, { t: 'File', path: 1 }, { t: 'Own time', n: 1 }, { t: 'Own', n: 1 },
      { t: 'Total time', n: 1 }, { t: 'Calls', n: 1 }, { t: 'Resumes', n: 1 }], rows, 25));
    if (R.functions.some((f) => f.resumes)) sec.append(note('Calls count a generator or coroutine once, when it starts; resumes count its later entries (cProfile counts both as calls).'));
  }

  function processes() {
    const ps = R.processes || [];
    if (ps.length < 2) return;
    const sec = document.getElementById('processes');
    sec.hidden = false;
    sec.append(table([{ t: 'PID', n: 1 }, { t: 'Parent', n: 1 }, { t: 'Command' }, { t: 'Threads', n: 1 }, { t: sampled ? 'Samples' : 'Own time', n: 1 }],
      ps.map((p) => [String(p.pid), p.parent == null ? '' : String(p.parent), p.command, count(p.threads), sampled ? count(p.samples) : ns(p.own_ns)]), 20));
  }

  function gc() {
    const sec = document.getElementById('gc');
    const gens = R.gc || [];
    if (!gens.length) { sec.append(note('No garbage collection was recorded (the gc probes fire on CPython builds with them; sampling sees the collector only in stacks).')); return; }
    const spent = gens.reduce((a, g) => a + g.total_ns, 0);
    if (R.duration_ns) sec.append(note('Collections took ' + ns(spent) + ', ' + pct(spent, R.duration_ns) + ' of the run.'));
    sec.append(table([{ t: 'Generation', n: 1 }, { t: 'Collections', n: 1 }, { t: 'Collected', n: 1 }, { t: 'Total pause', n: 1 }, { t: 'Longest', n: 1 }],
      gens.map((g) => [String(g.generation), count(g.collections), count(g.collected), ns(g.total_ns), ns(g.max_ns)]), 10));
    for (const g of gens) {
      const tr = g.triggers || [];
      if (!tr.length) continue;
      sec.append(el('h3', { text: 'Generation ' + g.generation + ': what was running when it started' }));
      sec.append(table([{ t: 'Function' }, { t: 'File', path: 1 }, { t: 'Collections', n: 1 }],
        tr.map((x) => [x.function, where(x.file, x.line), count(x.count)]), 5));
    }
  }

  function imports() {
    const sec = document.getElementById('imports');
    const im = (R.imports || []).slice().sort((a, b) => b.total_ns - a.total_ns);
    if (!im.length) { sec.append(note('No import was recorded (the import probes fire on CPython builds with them).')); return; }
    const rows = im.map((i) => [i.module + (i.found ? '' : ' (not found)'), i.importer || '', ns(i.total_ns), ns(i.self_ns), count(i.count)]);
    const headers = [{ t: 'Module' }, { t: 'Imported by' }, { t: 'Total', n: 1 }, { t: 'Own', n: 1 }, { t: 'Times', n: 1 }];
    sec.append(table(headers, rows.slice(0, 20), 20));
    if (rows.length > 20) {
      const d = el('details', { class: 'more' }, el('summary', { text: '… ' + count(rows.length - 20) + ' more imports' }));
      d.append(table(headers, rows.slice(20), 200));
      sec.append(d);
    }
  }

  function audit() {
    const sec = document.getElementById('audit');
    const ev = (R.audit || []).slice().sort((a, b) => b.count - a.count);
    if (!ev.length) { sec.append(note('No audit event was recorded.')); return; }
    // As the text report: stacks raising an event from the same line are one
    // call site.
    const shortFrame = (f) => f.replace(/\(([^()]*?):(\d+)\)$/, (_, file, line) => '(' + shortPath(file) + ':' + line + ')');
    const rows = ev.map((a) => {
      const sites = new Map();
      for (const s of a.stacks || []) {
        const key = s.frames.slice(-1).map(shortFrame).join('');
        sites.set(key, (sites.get(key) || 0) + s.count);
      }
      const merged = [...sites].sort((x, y) => y[1] - x[1]);
      const shown = merged.slice(0, 3).map(([k, n]) => k + ' ×' + count(n));
      if (merged.length > 3) shown.push('… ' + (merged.length - 3) + ' more call sites');
      return [a.event, count(a.count), el('span', {}, ...shown.flatMap((s, i) => i ? [el('br'), s] : [s]))];
    });
    sec.append(table([{ t: 'Event' }, { t: 'Count', n: 1 }, { t: 'Raised at (busiest call sites)' }], rows, 20));
  }

  function returns() {
    const sec = document.getElementById('returns');
    const rt = (R.return_types || []).map((r) => ({ r, n: r.returned.reduce((a, x) => a + x.count, 0) + (r.raised || 0) }));
    if (!rt.length) { sec.append(note('No return type was recorded (traced recordings on CPython builds whose return probe carries the value).')); return; }
    rt.sort((a, b) => b.n - a.n);
    const rows = rt.map(({ r, n }) => {
      const types = r.returned.slice().sort((a, b) => b.count - a.count);
      const shown = types.slice(0, 5).map((x) => x.type + ' ×' + count(x.count));
      if (types.length > 5) shown.push('… ' + (types.length - 5) + ' more');
      if (r.raised) shown.push('raised ×' + count(r.raised));
      return [r.function, where(r.file, r.line), count(n), shown.join(', ')];
    });
    sec.append(table([{ t: 'Function' }, { t: 'File', path: 1 }, { t: 'Returns', n: 1 }, { t: 'Types (top 5)' }], rows, 20));
  }

  function heat(own, max) {
    if (!own || !max) return '';
    const a = 0.12 + 0.75 * own / max;
    return 'rgba(232, 90, 30, ' + a.toFixed(2) + ')';
  }
  function sources() {
    const sec = document.getElementById('sources');
    const files = D.sources || [];
    if (!files.length) { sec.append(note('No line was sampled or hit (traced calls carry no line; record with --mode sample, or --probes line).')); return; }
    for (const s of files) {
      const own = s.lines.reduce((a, l) => a + l[1], 0);
      const hits = s.lines.reduce((a, l) => a + l[3], 0);
      const max = s.lines.reduce((a, l) => Math.max(a, l[1] || l[3]), 0);
      const h = el('h3', { text: shortPath(s.file) + ' — ' + (own ? count(own) + ' own samples' : '') + (own && hits ? ', ' : '') + (hits ? count(hits) + ' line hits' : '') });
      h.title = s.file;
      sec.append(h);
      if (!s.text) sec.append(note('Source not shown: ' + (s.missing || 'not readable') + '.'));
      const byLine = new Map(s.lines.map((l) => [l[0], l]));
      const t = el('table', { class: 'src' });
      t.append(el('tr', {}, el('th', { class: 'n', text: 'Line' }), el('th', { class: 'n', text: 'Own' }), el('th', { class: 'n', text: 'Total' }), el('th', { class: 'n', text: 'Hits' }), el('th', { text: 'Source' })));
      // Lines with counts and two lines around them; gaps marked.
      const show = new Set();
      const last = s.text ? s.text.length : s.lines.reduce((a, l) => Math.max(a, l[0]), 0);
      for (const l of s.lines) for (let i = l[0] - 2; i <= l[0] + 2; i++) if (i >= 1 && i <= last) show.add(i);
      let prev = 0;
      for (const i of [...show].sort((a, b) => a - b)) {
        if (i > prev + 1) t.append(el('tr', { class: 'gap' }, el('td', { class: 'n', text: '⋮' })));
        const l = byLine.get(i) || [i, 0, 0, 0];
        const tr = el('tr', {}, el('td', { class: 'n', text: String(i) }), el('td', { class: 'n', text: l[1] ? count(l[1]) : '' }),
          el('td', { class: 'n', text: l[2] ? count(l[2]) : '' }), el('td', { class: 'n', text: l[3] ? count(l[3]) : '' }),
          el('td', { class: 'code', text: s.text && s.text[i - 1] !== undefined ? s.text[i - 1] : '' }));
        tr.style.background = heat(l[1] || l[3], max);
        tr.dataset.line = String(i);
        t.append(tr);
        prev = i;
      }
      sec.append(t);
    }
  }

  function summary() {
    const aside = document.getElementById('summary');
    const dl = el('dl');
    const add = (k, v) => { dl.append(el('dt', { text: k }), el('dd', { text: v })); };
    const tgt = R.target || {};
    add('Process', 'pid ' + tgt.pid);
    if (tgt.python) add('Python', tgt.python);
    add('Mode', R.mode + (sampled ? ' (sampled' + (D.sample_interval_ns ? ', every ' + ns(D.sample_interval_ns) : '') + ')' : ''));
    add('Duration', ns(R.duration_ns || 0));
    add('Events', count(R.events || 0));
    if (sampled && R.sample_filter) add('Samples', count(R.sample_filter.kept) + ' counted of ' + count(R.sample_filter.samples));
    add('Lost events', count(R.lost_events || 0));
    const gcNs = (R.gc || []).reduce((a, g) => a + g.total_ns, 0);
    if (gcNs) add('GC', ns(gcNs) + ' (' + pct(gcNs, R.duration_ns) + ')');
    const threads = R.threads || [];
    if (threads.length) {
      const tot = threads.reduce((a, t) => a + (sampled ? t.events : t.exclusive_ns), 0);
      add('Threads', String(threads.length));
      for (const t of threads.slice().sort((a, b) => (sampled ? b.events - a.events : b.exclusive_ns - a.exclusive_ns)).slice(0, 8)) {
        dl.append(el('dd', { text: 'tid ' + t.tid + ': ' + pct(sampled ? t.events : t.exclusive_ns, tot) }));
      }
    }
    if (D.pruned && D.pruned.stacks) add('Left out of the graph', count(D.pruned.stacks) + ' stacks below ' + value(D.pruned.min_total) + ', counted in their callers');
    for (const c of R.caveats || []) add('Caveat', c.text);
    aside.append(el('h2', { text: 'Summary' }), dl);
  }

  document.getElementById('subtitle').textContent = D.subtitle;
  summary();
  fillThreads();
  rebuild();
  hotspots();
  processes();
  gc();
  imports();
  audit();
  returns();
  sources();
  document.body.dataset.ready = '1';
})();
