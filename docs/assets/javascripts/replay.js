// The replay page: a recorded engine run (milestones/recorder.py) stepped through forward and back.
// Loaded on every page with the site's other scripts; it does something only where a page holds <div id="replay">.
// No library and no network: the recordings are JSON files served with the site, or a learner's own file.
(function () {
  "use strict";

  const LABELS = {
    en: {
      run: "Recording", own: "or load your own:", prev: "Previous step", next: "Next step", step: "Step",
      after: "after the run", of: "of", batch: "The step's batch", request: "request", before: "computed before",
      fresh: "new tokens", kind: "kind", prefill: "prompt chunk", decode: "decode", guesses: "guesses checked",
      kept: "kept",
      waiting: "Waiting", none: "none", pool: "The KV pool", free: "free", cached: "cached by the tree",
      inUse: "in use", shared: "shared", noPool: "This milestone keeps no block pool (m3 brings it).",
      tree: "The radix tree", noTree: "This milestone has no prefix cache (m4 brings it).", node: "node",
      blocks: "blocks", locks: "locked by", chart: "Tokens computed per step", preemptions: "preemptions so far",
      error: "Could not read this recording", spans: "Host and device, this step and its neighbours",
    },
    zh: {
      run: "录制", own: "或载入你自己的：", prev: "上一步", next: "下一步", step: "第", after: "运行结束后", of: "步，共",
      batch: "这一步的批次", request: "请求", before: "此前已算", fresh: "新 token", kind: "类型", prefill: "提示词分块",
      decode: "解码", guesses: "待验证的猜测", kept: "保留", waiting: "等待队列", none: "无", pool: "KV 池", free: "空闲",
      cached: "树缓存", inUse: "使用中", shared: "共享", noPool: "这个里程碑还没有块池（m3 才有）。", tree: "基数树",
      noTree: "这个里程碑还没有前缀缓存（m4 才有）。", node: "节点", blocks: "块", locks: "锁数", chart: "每步计算的 token 数",
      preemptions: "累计抢占", error: "无法读取这份录制", spans: "主机与设备：这一步及前后各一步",
    },
  };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) if (child) node.append(child);
    return node;
  }

  function colour(request) {
    return `hsl(${(request * 137.508) % 360}, 62%, 58%)`;
  }

  // Every frame's whole block tables and tree, rebuilt from the file's changes (each is written where it changed).
  function frames(record) {
    const steps = [...record.steps, { ...record.end, end: true }];
    let tables = {}, tree = undefined;
    return steps.map((step) => {
      if (step.tables) {
        tables = { ...tables };
        for (const gone of step.gone || []) delete tables[gone];
        Object.assign(tables, step.tables);
      }
      if (step.tree) tree = step.tree;
      return { ...step, allTables: tables, tree };
    });
  }

  function poolView(record, frame, L) {
    if (record.num_blocks === null || frame.free === undefined) return el("p", { class: "replay-note", text: L.noPool });
    const owners = new Map();
    for (const [request, table] of Object.entries(frame.allTables)) {
      for (const block of table) owners.set(block, [...(owners.get(block) || []), Number(request)]);
    }
    const cached = new Set((frame.tree || []).flatMap((node) => node[2]));
    const grid = el("div", { class: "replay-pool", "data-in-use": owners.size, "data-free": frame.free });
    for (let block = 0; block < record.num_blocks; block++) {
      const holders = owners.get(block) || [];
      const cell = el("span", { class: "replay-block" });
      let title = `${block}: `;
      if (holders.length) {
        cell.style.background = colour(holders[0]);
        cell.dataset.state = "in-use";
        title += `${L.inUse}, ${L.request} ${holders.join(", ")}`;
        if (holders.length > 1) cell.classList.add("replay-shared");
      } else if (cached.has(block)) {
        cell.dataset.state = "cached";
        title += L.cached;
      } else {
        cell.dataset.state = "free";
        title += L.free;
      }
      cell.title = title;
      grid.append(cell);
    }
    const legend = el("p", { class: "replay-note",
      text: `${L.inUse} ${owners.size} · ${L.cached} ${[...cached].filter((b) => !owners.has(b)).length} · ` +
            `${L.free} ${frame.free} · ${L.preemptions} ${frame.preemptions}` });
    return el("div", {}, grid, legend);
  }

  function batchView(frame, L) {
    if (!frame.batch.length) return el("p", { class: "replay-note", text: L.none });
    const head = el("tr", {}, ...[L.request, L.before, L.fresh, L.kind, L.guesses].map((t) => el("th", { text: t })));
    const rows = frame.batch.map(([request, before, fresh, guesses, kept]) => {
      const swatch = el("span", { class: "replay-swatch" });
      swatch.style.background = colour(request);
      const kind = fresh - guesses > 1 ? L.prefill : L.decode;
      return el("tr", { "data-request": request }, el("td", {}, swatch, ` ${request}`), el("td", { text: before }),
                el("td", { text: fresh }), el("td", { text: kind }),
                el("td", { text: guesses ? (kept === undefined ? guesses : `${guesses} (${L.kept} ${kept})`) : "" }));
    });
    return el("table", { class: "replay-batch" }, el("thead", {}, head), el("tbody", {}, ...rows));
  }

  function treeView(frame, L) {
    if (!frame.tree) return el("p", { class: "replay-note", text: L.noTree });
    if (!frame.tree.length) return el("p", { class: "replay-note", text: L.none });
    const children = new Map();
    for (const node of frame.tree) children.set(node[1], [...(children.get(node[1]) || []), node]);
    const list = (parent) => el("ul", {}, ...(children.get(parent) || []).map(([id, , blocks, locks]) =>
      el("li", { "data-locks": locks }, `${L.node} ${id}: ${L.blocks} ${blocks.join(" ")}` +
         (locks ? ` · ${L.locks} ${locks}` : ""), children.has(id) ? list(id) : null)));
    return el("div", { class: "replay-tree" }, list(-1));
  }

  function chartView(all, index, L) {
    const width = 600, height = 90, totals = all.map((f) => f.batch.reduce((sum, entry) => sum + entry[2], 0));
    const most = Math.max(1, ...totals), bar = width / all.length;
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    svg.setAttribute("class", "replay-chart");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", L.chart);
    totals.forEach((total, i) => {
      const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
      const h = (total / most) * (height - 4);
      rect.setAttribute("x", i * bar);
      rect.setAttribute("y", height - h);
      rect.setAttribute("width", Math.max(1, bar - 1));
      rect.setAttribute("height", h);
      rect.setAttribute("class", i === index ? "replay-bar replay-bar-now" : "replay-bar");
      svg.append(rect);
    });
    return svg;
  }

  // m6 on, traced: the spans of this step and its neighbours on three rows, the host's (schedule, process) and the
  // device's (forward): with overlap, the next step's schedule sits inside this step's forward.
  function spansView(record, index, L) {
    const near = record.spans.filter((span) => Math.abs(span[0] - index) <= 1);
    if (!near.length) return el("p", { class: "replay-note", text: L.none });
    const rows = ["schedule", "forward", "process"], width = 600, row = 18, left = 70;
    const start = Math.min(...near.map((s) => s[2])), end = Math.max(...near.map((s) => s[2] + s[3]));
    const x = (ms) => left + ((ms - start) / Math.max(end - start, 1e-6)) * (width - left - 4);
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${rows.length * row + 16}`);
    svg.setAttribute("class", "replay-chart replay-spans");
    rows.forEach((name, r) => {
      const text = document.createElementNS("http://www.w3.org/2000/svg", "text");
      text.setAttribute("x", 0);
      text.setAttribute("y", r * row + 13);
      text.setAttribute("class", "replay-span-label");
      text.textContent = name;
      svg.append(text);
    });
    for (const [step, name, at, ms] of near) {
      const rect = document.createElementNS("http://www.w3.org/2000/svg", "rect");
      rect.setAttribute("x", x(at));
      rect.setAttribute("y", rows.indexOf(name) * row + 2);
      rect.setAttribute("width", Math.max(1.5, x(at + ms) - x(at)));
      rect.setAttribute("height", row - 4);
      rect.setAttribute("class", step === index ? "replay-bar replay-bar-now" : "replay-bar");
      const title = document.createElementNS("http://www.w3.org/2000/svg", "title");
      title.textContent = `${L.step} ${step + 1}: ${name} ${ms.toFixed(2)} ms`;
      rect.append(title);
      svg.append(rect);
    }
    const note = el("p", { class: "replay-note", text: `${(end - start).toFixed(1)} ms` });
    return el("div", { "data-spans": near.length }, svg, note);
  }

  function section(title, body) {
    return el("section", { class: "replay-section" }, el("h4", { text: title }), body);
  }

  function start(root) {
    const L = LABELS[(document.documentElement.lang || "en").startsWith("zh") ? "zh" : "en"];
    const base = new URL("../replay/", SCRIPT_URL);  // the recordings: docs/assets/replay/
    const runs = (root.dataset.runs || "").split(",").filter(Boolean);
    const picker = el("select", { "aria-label": L.run }, ...runs.map((run) => el("option", { value: run, text: run })));
    const file = el("input", { type: "file", accept: ".json,application/json" });
    const prev = el("button", { type: "button", class: "md-button", text: "←", title: L.prev, "aria-label": L.prev });
    const next = el("button", { type: "button", class: "md-button", text: "→", title: L.next, "aria-label": L.next });
    const slider = el("input", { type: "range", min: "0", max: "0", value: "0", "aria-label": L.step });
    const label = el("span", { class: "replay-label" });
    const view = el("div", { class: "replay-view" });
    root.replaceChildren(el("div", { class: "replay-controls" }, el("label", {}, `${L.run} `, picker), ` ${L.own} `,
                                    file),
                         el("div", { class: "replay-controls" }, prev, slider, next, label), view);
    let record = null, all = [], index = 0;

    function show(i) {
      index = Math.max(0, Math.min(all.length - 1, i));
      slider.value = String(index);
      const frame = all[index];
      label.textContent = frame.end ? L.after
        : (L === LABELS.zh ? `${L.step} ${index + 1} ${L.of} ${all.length - 1} 步`
                           : `${L.step} ${index + 1} ${L.of} ${all.length - 1}`);
      const parts = [
        section(L.batch, batchView(frame, L)),
        section(L.waiting, el("p", { class: "replay-note", text: frame.waiting.length ? frame.waiting.join(", ") : L.none })),
        section(L.pool, poolView(record, frame, L)),
        section(L.tree, treeView(frame, L)),
        section(L.chart, chartView(all, index, L)),
      ];
      if ((record.spans || []).length && !frame.end) parts.push(section(L.spans, spansView(record, index, L)));
      view.replaceChildren(...parts);
      root.dataset.frame = String(index);
      root.dataset.frames = String(all.length);
    }

    function load(data, name) {
      record = data;
      all = frames(record);
      slider.max = String(all.length - 1);
      root.dataset.run = name;
      show(0);
    }

    function fail(error) {
      view.replaceChildren(el("p", { class: "replay-note", text: `${L.error}: ${error}` }));
      root.dataset.error = String(error);
    }

    function fetchRun(run) {
      fetch(new URL(`${run}.json`, base)).then((r) => r.json()).then((data) => load(data, run)).catch(fail);
    }

    picker.addEventListener("change", () => fetchRun(picker.value));
    file.addEventListener("change", () => {
      const chosen = file.files[0];
      if (chosen) chosen.text().then((text) => load(JSON.parse(text), chosen.name)).catch(fail);
    });
    prev.addEventListener("click", () => show(index - 1));
    next.addEventListener("click", () => show(index + 1));
    slider.addEventListener("input", () => show(Number(slider.value)));
    root.tabIndex = 0;
    root.addEventListener("keydown", (event) => {
      const moves = { ArrowLeft: index - 1, ArrowRight: index + 1, Home: 0, End: all.length - 1 };
      if (event.key in moves && event.target.tagName !== "INPUT") {
        event.preventDefault();
        show(moves[event.key]);
      }
    });
    const wanted = new URLSearchParams(location.search).get("run");
    const first = runs.includes(wanted) ? wanted : runs[0];
    picker.value = first;
    fetchRun(first);
  }

  const SCRIPT_URL = document.currentScript.src;  // read now: a script's own address is known only as it runs
  function boot() {
    const root = document.getElementById("replay");
    if (root && !root.dataset.started) {
      root.dataset.started = "1";
      start(root);
    }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", boot);
  else boot();
})();
