// The scale planner's form. All arithmetic is in window.PlannerModel, generated at build time from
// snippets/planner/cost_model.py (see snippets/planner/to_js.py): this file only reads the form,
// calls PlannerModel.plan_training, prints the result and draws it as two SVG charts (the memory
// bar and the pipeline schedule; tests/test_browser.py checks both against the Python).
(function () {
  "use strict";

  const PLAN_FIELDS = [
    // [key, label, kind, default, choices]
    ["dp", "Data-parallel size (dp)", "int", 8],
    ["tp", "Tensor-parallel size (tp)", "int", 1],
    ["pp", "Pipeline stages (pp)", "int", 1],
    ["virtual_stages", "Interleaved chunks per pipeline rank (v)", "int", 1],
    ["first_stage_layers", "Layers on the first pipeline stage (0: the default split)", "int", 0],
    ["last_stage_layers", "Layers on the last pipeline stage (0: the default split)", "int", 0],
    ["cp", "Context-parallel size (cp)", "int", 1],
    ["cp_overlap", "Overlap ring attention with compute", "bool", true],
    ["sp", "Sequence parallelism (with tp)", "bool", false],
    ["ep", "Expert-parallel size (ep, MoE models; within dp × cp)", "int", 1],
    ["ep_overlap", "Overlap the expert all-to-alls with compute", "bool", false],
    ["zero_stage", "ZeRO stage", "select", "1", ["0", "1", "2", "3"]],
    ["precision", "Precision", "select", "bf16", ["fp32", "bf16", "fp8"]],
    ["fp32_main_grads", "Gradients in fp32 (Megatron-LM's main grads)", "bool", false],
    ["recompute", "Recompute activations", "select", "none", ["none", "selective", "full"]],
    ["micro_batch_size", "Micro-batch size (sequences)", "int", 1],
    ["micro_batches", "Micro-batches per step (per dp rank)", "int", 8],
    ["seq_len", "Sequence length", "int", 2048],
    ["schedule", "Pipeline schedule", "select", "1f1b", ["1f1b", "gpipe"]],
    ["mfu", "Fraction of peak FLOP/s the matmuls reach", "float", 0.4],
    ["flops", "FLOPs counted in MFU", "select", "matmuls+attention", ["matmuls+attention", "matmuls+causal-attention", "matmuls", "6N"]],
  ];
  // The model's shape, filled in from the preset and editable: a model of one's own.
  const MODEL_FIELDS = [
    ["num_hidden_layers", "Layers", "int"],
    ["hidden_size", "Hidden size", "int"],
    ["intermediate_size", "FFN width", "int"],
    ["num_attention_heads", "Attention heads", "int"],
    ["num_key_value_heads", "Key/value heads", "int"],
    ["vocab_size", "Vocabulary", "int"],
  ];
  const CLUSTER_FIELDS = [
    ["gpus_per_node", "GPUs per node", "int"],
    ["gpu_memory_gb", "Memory per GPU (GB)", "float"],
    ["intra_node_gbps", "Intra-node bandwidth (GB/s)", "float"],
    ["intra_node_latency_us", "Intra-node latency (µs)", "float"],
    ["inter_node_gbps", "Inter-node bandwidth (GB/s per GPU)", "float"],
    ["inter_node_latency_us", "Inter-node latency (µs)", "float"],
  ];

  function field(key, label, kind, value, choices) {
    const id = "planner-" + key;
    let input;
    if (kind === "select") {
      input = `<select id="${id}" data-key="${key}">` + choices.map(
        (c) => `<option value="${c}"${String(c) === String(value) ? " selected" : ""}>${c}</option>`
      ).join("") + "</select>";
    } else if (kind === "bool") {
      input = `<input type="checkbox" id="${id}" data-key="${key}"${value ? " checked" : ""}>`;
    } else {
      const step = kind === "int" ? "1" : "any";
      input = `<input type="number" id="${id}" data-key="${key}" step="${step}" value="${value}">`;
    }
    return `<label for="${id}">${label}</label>${input}`;
  }

  function read(root, fields) {
    const out = {};
    for (const [key, , kind] of fields) {
      const el = root.querySelector(`[data-key="${key}"]`);
      if (kind === "bool") out[key] = el.checked;
      else if (kind === "select") out[key] = key === "zero_stage" ? Number(el.value) : el.value;
      else out[key] = Number(el.value);
    }
    return out;
  }

  const gb = (bytes) => (bytes / 1e9).toFixed(2) + " GB";
  const seconds = (s) => (s >= 1 ? s.toFixed(3) + " s" : (s * 1e3).toFixed(2) + " ms");


  // ---- Charts: SVG drawn from the model's own numbers (no chart library). ----

  const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  const SVG_NS = 'xmlns="http://www.w3.org/2000/svg"';
  let chartId = 0;  // unique ids for title/desc/pattern within the page

  // Memory per rank, one segment per kind of bytes. "Other" is whatever the model adds beyond the
  // four named kinds (ZeRO-3's gathered block, and any term a newer model reports).
  const MEMORY_PARTS = [
    ["weights", "Parameters"], ["gradients", "Gradients"], ["optimizer", "Optimizer state"],
    ["activations", "Activations"], ["other", "Buffers and other"],
  ];

  function memoryParts(memory) {
    const named = ["weights", "gradients", "optimizer", "activations"];
    const parts = {};
    for (const k of named) parts[k] = memory[k];
    parts.other = memory.total - named.reduce((sum, k) => sum + memory[k], 0);
    return parts;
  }

  // The bar against the GPU's capacity, whose last `reserved` bytes (the cost model's
  // RESERVED_GB: CUDA context, NCCL buffers, fragmentation) are shaded: the tensors fit when
  // they end before the shading.
  function memoryBar(memory, capacity, reserved) {
    const id = "planner-mem-" + (++chartId);
    const parts = memoryParts(memory);
    const W = 600, H = 56, bar = 30, top = 8;
    const scale = W / Math.max(memory.total, capacity) * 0.97;
    const usable = capacity - reserved;
    const over = memory.total + reserved > capacity;  // as the cost model decides "fits"
    let x = 0, rects = "";
    for (const [key, label] of MEMORY_PARTS) {
      const w = parts[key] * scale;
      rects += `<rect class="planner-mem-${key}" data-part="${key}" data-bytes="${parts[key]}"` +
        ` x="${x.toFixed(2)}" y="${top}" width="${Math.max(0, w).toFixed(2)}" height="${bar}">` +
        `<title>${label}: ${gb(parts[key])}</title></rect>`;
      x += Math.max(0, w);
    }
    const cx = capacity * scale, ux = usable * scale;
    rects += `<rect class="planner-mem-reserved" data-reserved-bytes="${reserved}" x="${ux.toFixed(2)}"` +
      ` y="${top}" width="${(cx - ux).toFixed(2)}" height="${bar}" fill="currentColor"` +
      ` fill-opacity="0.15"><title>Reserved: ${gb(reserved)}</title></rect>`;
    if (over) {  // the part beyond the usable memory, hatched and outlined
      rects += `<rect class="planner-mem-over" data-over-capacity="true" x="${ux.toFixed(2)}"` +
        ` y="${top - 4}" width="${(x - ux).toFixed(2)}" height="${bar + 8}"` +
        ` fill="url(#${id}-over)"><title>Over capacity by ${gb(memory.total - usable)}</title></rect>`;
    }
    rects += `<line class="planner-mem-capacity" x1="${cx.toFixed(2)}" x2="${cx.toFixed(2)}"` +
      ` y1="0" y2="${H}" vector-effect="non-scaling-stroke" data-bytes="${capacity}"/>`;
    const summary = `${gb(memory.total)} per GPU of ${gb(capacity)}, ${gb(reserved)} of it reserved` +
      (over ? `: over capacity by ${gb(memory.total - usable)}` : `: fits`);
    const desc = MEMORY_PARTS.map(([k, l]) => `${l} ${gb(parts[k])}`).join(", ");
    const legend = MEMORY_PARTS.map(([k, l]) =>
      `<li><span class="planner-swatch planner-mem-${k}" aria-hidden="true"></span>${l} ` +
      `<span data-legend="${k}">${gb(parts[k])}</span></li>`).join("") +
      `<li><span class="planner-swatch planner-swatch-capacity" aria-hidden="true"></span>` +
      `GPU memory ${gb(capacity)}, the last ${gb(reserved)} shaded: reserved</li>`;
    return `<figure class="planner-chart planner-memory${over ? " planner-over" : ""}">` +
      `<figcaption>Memory per GPU (busiest rank): <strong>${summary}</strong></figcaption>` +
      `<svg ${SVG_NS} role="img" aria-labelledby="${id}-t ${id}-d" viewBox="0 0 ${W} ${H}"` +
      ` preserveAspectRatio="none" data-total-bytes="${memory.total}" data-capacity-bytes="${capacity}"` +
      ` data-over-capacity="${over}">` +
      `<title id="${id}-t">Memory per GPU: ${summary}</title><desc id="${id}-d">${desc}.</desc>` +
      `<defs><pattern id="${id}-over" width="8" height="8" patternUnits="userSpaceOnUse"` +
      ` patternTransform="rotate(45)"><rect width="8" height="8" class="planner-over-bg"/>` +
      `<line x1="0" y1="0" x2="0" y2="8" class="planner-hatch-line"/></pattern></defs>` +
      rects + `</svg><ul class="planner-legend">${legend}</ul></figure>`;
  }

  // The order each stage runs its forwards (F) and backwards (B), as in the course's
  // snippets/scratch/pipeline.py SCHEDULES (tests/test_browser.py checks they agree). Entries
  // are [kind, micro_batch, chunk]; chunk is 0 unless interleaved.
  function gpipeOrder(m, stage, p) {
    const out = [];
    for (let i = 0; i < m; i++) out.push(["F", i, 0]);
    for (let i = 0; i < m; i++) out.push(["B", i, 0]);
    return out;
  }

  function oneFOneBOrder(m, stage, p) {
    const warmup = Math.min(p - stage - 1, m), out = [];
    for (let i = 0; i < warmup; i++) out.push(["F", i, 0]);
    for (let i = 0; i < m - warmup; i++) out.push(["F", warmup + i, 0], ["B", i, 0]);
    for (let i = m - warmup; i < m; i++) out.push(["B", i, 0]);
    return out;
  }

  // Interleaved 1F1B (Narayanan et al. 2021, section 2.2; Megatron-LM's order): rank `stage` holds
  // chunks c = 0..v-1, model stages c*p + stage. The k-th forward is micro-batch
  // floor(k / pv) * p + k % p of chunk floor(k / p) % v; backwards run the chunks in reverse.
  function interleavedOrder(m, stage, p, v) {
    const total = m * v;
    const mb = (k) => Math.floor(k / (p * v)) * p + (k % p);
    const chunk = (k) => Math.floor(k / p) % v;
    const warmup = Math.min((p - stage - 1) * 2 + (v - 1) * p, total), out = [];
    let f = 0, b = 0;
    for (; f < warmup; f++) out.push(["F", mb(f), chunk(f)]);
    while (f < total) {
      out.push(["F", mb(f), chunk(f)]); f++;
      out.push(["B", mb(b), v - 1 - chunk(b)]); b++;
    }
    for (; b < total; b++) out.push(["B", mb(b), v - 1 - chunk(b)]);
    return out;
  }

  function scheduleOrder(name, m, stage, p, v) {
    if (v > 1) return interleavedOrder(m, stage, p, v);
    return name === "gpipe" ? gpipeOrder(m, stage, p) : oneFOneBOrder(m, stage, p);
  }

  // Run the orders on p ranks with a forward taking 1/v and a backward 2/v time units: each op
  // starts when its rank is free and its input is ready (the previous model stage's forward, the
  // next one's backward). Returns per-rank busy intervals and the span, or null on a deadlock.
  function simulate(name, m, p, v) {
    const orders = [];
    for (let s = 0; s < p; s++) orders.push(scheduleOrder(name, m, s, p, v));
    const done = {}, ops = orders.map(() => []), free = new Array(p).fill(0), next = new Array(p).fill(0);
    const last = p * v - 1;
    let progress = true;
    while (progress) {
      progress = false;
      for (let s = 0; s < p; s++) {
        while (next[s] < orders[s].length) {
          const [kind, i, c] = orders[s][next[s]];
          const model = c * p + s;  // this op's model stage
          const need = kind === "F" ? (model > 0 ? `F${i}@${model - 1}` : null)
                                    : (model < last ? `B${i}@${model + 1}` : `F${i}@${model}`);
          if (need !== null && !(need in done)) break;
          const start = Math.max(free[s], need === null ? 0 : done[need]);
          const end = start + (kind === "F" ? 1 : 2) / v;
          done[`${kind}${i}@${model}`] = end;
          ops[s].push({kind, micro_batch: i, chunk: c, start, end});
          free[s] = end; next[s]++; progress = true;
        }
      }
    }
    if (next.some((n, s) => n < orders[s].length)) return null;
    return {ops, span: Math.max(...free)};
  }

  const MAX_DRAWN_MICRO_BATCHES = 16;

  function scheduleChart(plan, r, width) {
    const p = plan.pp, v = plan.virtual_stages || 1;
    if (p === 1) return "";
    let m = Math.min(plan.micro_batches, MAX_DRAWN_MICRO_BATCHES);
    // The interleaved order cycles through the ranks' micro-batches p at a time: draw whole cycles.
    if (v > 1) m = Math.max(p, Math.floor(m / p) * p);
    const capped = m !== plan.micro_batches;
    const name = v > 1 ? "interleaved 1F1B" : (plan.schedule === "gpipe" ? "GPipe" : "1F1B");
    const sim = simulate(plan.schedule, m, p, v);
    if (!sim) return `<p class="planner-chart">The ${name} order stalls for p=${p}, m=${m}, v=${v}.</p>`;
    const id = "planner-pipe-" + (++chartId);
    const rowH = 26, gap = 6, left = 64, top = 4;
    // px per forward of a whole stage: fill the page's width, scroll sideways below 8 px
    const unit = Math.max(8, Math.min(30, (width - left - 4) / sim.span));
    const W = left + sim.span * unit + 4, H = top + p * (rowH + gap);
    let body = "", idle = 0;
    for (let s = 0; s < p; s++) {
      const y = top + s * (rowH + gap);
      body += `<text class="planner-pipe-rank" x="${left - 6}" y="${y + rowH / 2}">rank ${s}</text>`;
      let t = 0;
      const gapRect = (a, b) => {
        if (b - a < 1e-9) return "";
        idle += b - a;
        return `<rect class="planner-pipe-bubble" data-idle="${b - a}" x="${(left + a * unit).toFixed(2)}"` +
          ` y="${y}" width="${((b - a) * unit).toFixed(2)}" height="${rowH}" fill="url(#${id}-hatch)">` +
          `<title>rank ${s} idle</title></rect>`;
      };
      for (const op of sim.ops[s]) {
        body += gapRect(t, op.start);
        const x = left + op.start * unit, w = (op.end - op.start) * unit;
        const label = op.kind + op.micro_batch + (v > 1 ? "." + op.chunk : "");
        body += `<g class="planner-pipe-op planner-pipe-${op.kind}" data-kind="${op.kind}"` +
          ` data-micro-batch="${op.micro_batch}" data-chunk="${op.chunk}">` +
          `<rect x="${x.toFixed(2)}" y="${y}" width="${w.toFixed(2)}" height="${rowH}">` +
          `<title>rank ${s}: ${op.kind === "F" ? "forward" : "backward"} of micro-batch ` +
          `${op.micro_batch}${v > 1 ? ", chunk " + op.chunk : ""}</title></rect>` +
          (w >= 7 * label.length + 4 ? `<text x="${(x + w / 2).toFixed(2)}" y="${y + rowH / 2}">${label}</text>` : "") +
          `</g>`;
        t = op.end;
      }
      body += gapRect(t, sim.span);
    }
    const fraction = idle / (p * sim.span);
    const note = capped ? ` Drawn with ${m} of the ${plan.micro_batches} micro-batches` +
      ` (at most ${MAX_DRAWN_MICRO_BATCHES}${v > 1 ? ", whole rounds of p" : ""}); for all` +
      ` ${plan.micro_batches} the model's bubble is ${(100 * r.bubble_fraction).toFixed(1)}%.` : "";
    const summary = `${name}, ${p} ranks, ${m} micro-batches${v > 1 ? `, ${v} chunks per rank` : ""}:` +
      ` bubble ${(100 * fraction).toFixed(1)}% of rank-time (hatched)`;
    return `<figure class="planner-chart planner-schedule">` +
      `<figcaption>Pipeline schedule: <strong>${summary}</strong>.${note}</figcaption>` +
      `<div class="planner-scroll"><svg ${SVG_NS} role="img" aria-labelledby="${id}-t ${id}-d"` +
      ` width="${W.toFixed(0)}" height="${H}" viewBox="0 0 ${W.toFixed(2)} ${H}"` +
      ` data-stages="${p}" data-micro-batches="${m}" data-virtual-stages="${v}"` +
      ` data-span="${sim.span}" data-bubble-fraction="${fraction}">` +
      `<title id="${id}-t">Pipeline schedule: ${summary}</title>` +
      `<desc id="${id}-d">One row per pipeline rank, time to the right. F blocks are forwards, B blocks` +
      ` backwards (twice as long), labelled with the micro-batch${v > 1 ? " and chunk" : ""};` +
      ` hatched blocks are the bubble, where a rank waits.</desc>` +
      `<defs><pattern id="${id}-hatch" width="6" height="6" patternUnits="userSpaceOnUse"` +
      ` patternTransform="rotate(45)"><rect width="6" height="6" class="planner-bubble-bg"/>` +
      `<line x1="0" y1="0" x2="0" y2="6" class="planner-hatch-line"/></pattern></defs>` +
      body + `</svg></div>` +
      `<ul class="planner-legend"><li><span class="planner-swatch planner-pipe-F" aria-hidden="true"></span>F: forward</li>` +
      `<li><span class="planner-swatch planner-pipe-B" aria-hidden="true"></span>B: backward</li>` +
      `<li><span class="planner-swatch planner-swatch-bubble" aria-hidden="true"></span>bubble (idle)</li></ul>` +
      `</figure>`;
  }

  function render(root) {
    const M = window.PlannerModel;
    const model = Object.assign({}, M.MODELS[root.querySelector("#planner-model").value],
                                read(root, MODEL_FIELDS));
    const plan = read(root, PLAN_FIELDS);
    const cluster = Object.assign({}, M.CLUSTERS[root.querySelector("#planner-cluster").value],
                                  read(root, CLUSTER_FIELDS));
    cluster.peak_tflops = Object.assign({}, cluster.peak_tflops);
    cluster.peak_tflops[plan.precision] = Number(root.querySelector("#planner-peak").value);
    const out = root.querySelector(".planner-result");
    let r;
    try {
      r = M.plan_training(model, plan, cluster);
    } catch (err) {
      out.innerHTML = `<p class="planner-error" data-out="error">${err.message}</p>`;
      return;
    }
    const m = r.memory_bytes, t = r.time_s;
    const rows = [
      ["GPUs (dp × tp × pp × cp)", r.gpus, "gpus"],
      ["Parameters", (r.parameters / 1e9).toFixed(3) + " B", "parameters"],
      ["Parameters per GPU", (r.parameters_per_gpu / 1e9).toFixed(3) + " B", "parameters_per_gpu"],
      ["Weights", gb(m.weights), "weights"],
      ["Gradients", gb(m.gradients), "gradients"],
      ["Optimizer state", gb(m.optimizer), "optimizer"],
      ["ZeRO-3 gathered block", gb(m.zero3_gathered), "zero3_gathered"],
      ["Activations", gb(m.activations), "activations"],
      ["Memory per GPU (busiest stage)", gb(m.total), "memory"],
      ["Memory per stage: first / middle / last", ["first", "middle", "last"].map(
        (k) => `${gb(r.memory_per_stage[k].total)} (stage ${r.memory_per_stage[k].stage}, ` +
               `${r.memory_per_stage[k].layers} layers)`).join(" / "), "memory_per_stage"],
      ["Fits in memory", `${r.fits ? "yes" : "no"} (${(100 * r.memory_fraction).toFixed(0)}% with ` +
                         `${gb(r.reserved_bytes)} reserved)`, "fits"],
      ["Compute per step", seconds(t.compute), "compute"],
      ["Tensor-parallel all-reduces", seconds(t.tensor_parallel), "tensor_parallel"],
      ["Context-parallel K/V exchange (exposed)", seconds(t.context_parallel), "context_parallel"],
      ["Expert all-to-alls (exposed)", seconds(t.expert_parallel), "expert_parallel"],
      ["Pipeline sends", seconds(t.pipeline_p2p), "pipeline_p2p"],
      ["Pipeline bubble", `${seconds(t.bubble)} (${(100 * r.bubble_fraction).toFixed(1)}%)`, "bubble"],
      ["Data-parallel sync (exposed)", `${seconds(t.data_parallel)} (${seconds(t.data_parallel_exposed)})`, "data_parallel"],
      ["Step time", seconds(t.step), "step"],
      ["Tokens per step", r.tokens_per_step.toLocaleString("en-US"), "tokens_per_step"],
      ["Tokens per second", Math.round(r.tokens_per_s).toLocaleString("en-US"), "tokens_per_s"],
      ["Model FLOPs utilisation (MFU)", (100 * r.model_flops_utilization).toFixed(1) + "%", "model_flops_utilization"],
    ];
    out.innerHTML = memoryBar(m, cluster.gpu_memory_gb * 1e9, r.reserved_bytes) + scheduleChart(plan, r, out.clientWidth || 700) +
      "<table><tbody>" + rows.map(
      ([label, value, key]) => `<tr><th>${label}</th><td data-out="${key}">${value}</td></tr>`
    ).join("") + "</tbody></table>";
  }

  function fillCluster(root) {
    const c = window.PlannerModel.CLUSTERS[root.querySelector("#planner-cluster").value];
    for (const [key] of CLUSTER_FIELDS) root.querySelector(`[data-key="${key}"]`).value = c[key];
    fillPeak(root);
  }

  function fillModel(root) {
    const model = window.PlannerModel.MODELS[root.querySelector("#planner-model").value];
    for (const [key] of MODEL_FIELDS) root.querySelector(`[data-key="${key}"]`).value = model[key];
  }

  function fillPeak(root) {
    const c = window.PlannerModel.CLUSTERS[root.querySelector("#planner-cluster").value];
    const precision = root.querySelector('[data-key="precision"]').value;
    root.querySelector("#planner-peak").value = c.peak_tflops[precision];
  }

  function mount(root) {
    const M = window.PlannerModel;
    if (!M) {
      root.textContent = "The planner model (assets/js/planner-model.js) did not load.";
      return;
    }
    const options = (names, selected) => names.map(
      (n) => `<option value="${n}"${n === selected ? " selected" : ""}>${n}</option>`).join("");
    root.innerHTML = `
      <form class="planner-form" onsubmit="return false">
        <fieldset><legend>Model</legend>
          <label for="planner-model">Model</label>
          <select id="planner-model">${options(Object.keys(M.MODELS), "llama-7b")}</select>
          ${MODEL_FIELDS.map(([k, l, kind]) => field(k, l, kind, 0)).join("")}
        </fieldset>
        <fieldset><legend>Cluster</legend>
          <label for="planner-cluster">Preset</label>
          <select id="planner-cluster">${options(Object.keys(M.CLUSTERS), Object.keys(M.CLUSTERS)[0])}</select>
          ${CLUSTER_FIELDS.map(([k, l, kind]) => field(k, l, kind, 0)).join("")}
          <label for="planner-peak">Peak TFLOP/s at this precision</label>
          <input type="number" id="planner-peak" step="any" value="0">
        </fieldset>
        <fieldset><legend>Parallelism and batch</legend>
          ${PLAN_FIELDS.map(([k, l, kind, v, c]) => field(k, l, kind, v, c)).join("")}
        </fieldset>
      </form>
      <div class="planner-result" aria-live="polite"></div>`;
    fillModel(root);
    fillCluster(root);
    root.querySelector("#planner-model").addEventListener("change", () => fillModel(root));
    root.querySelector("#planner-cluster").addEventListener("change", () => fillCluster(root));
    root.querySelector('[data-key="precision"]').addEventListener("change", () => fillPeak(root));
    root.addEventListener("input", () => render(root));
    root.addEventListener("change", () => render(root));
    render(root);
  }

  function init() {
    const root = document.getElementById("planner-calculator");
    if (root) mount(root);
  }

  window.PlannerCalculator = {scheduleOrder, simulate, memoryParts, MAX_DRAWN_MICRO_BATCHES};
  if (typeof document === "undefined") return;  // loaded by a test runner, not a page
  if (typeof document$ !== "undefined") document$.subscribe(init);  // Material instant navigation
  else document.addEventListener("DOMContentLoaded", init);
})();
