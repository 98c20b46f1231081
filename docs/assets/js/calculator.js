// The scale planner's form. All arithmetic is in window.PlannerModel, generated at build time from
// snippets/planner/cost_model.py (see snippets/planner/to_js.py): this file only reads the form,
// calls PlannerModel.plan_training and prints the result.
(function () {
  "use strict";

  const PLAN_FIELDS = [
    // [key, label, kind, default, choices]
    ["dp", "Data-parallel size (dp)", "int", 8],
    ["tp", "Tensor-parallel size (tp)", "int", 1],
    ["pp", "Pipeline stages (pp)", "int", 1],
    ["virtual_stages", "Interleaved chunks per pipeline rank (v)", "int", 1],
    ["cp", "Context-parallel size (cp)", "int", 1],
    ["cp_overlap", "Overlap ring attention with compute", "bool", true],
    ["sp", "Sequence parallelism (with tp)", "bool", false],
    ["zero_stage", "ZeRO stage", "select", "1", ["0", "1", "2", "3"]],
    ["precision", "Precision", "select", "bf16", ["fp32", "bf16", "fp8"]],
    ["recompute", "Recompute activations", "select", "none", ["none", "selective", "full"]],
    ["micro_batch_size", "Micro-batch size (sequences)", "int", 1],
    ["micro_batches", "Micro-batches per step (per dp rank)", "int", 8],
    ["seq_len", "Sequence length", "int", 2048],
    ["schedule", "Pipeline schedule", "select", "1f1b", ["1f1b", "gpipe"]],
    ["mfu", "Fraction of peak FLOP/s the matmuls reach", "float", 0.4],
    ["flops", "FLOPs counted in MFU", "select", "matmuls+attention", ["matmuls+attention", "matmuls", "6N"]],
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

  function render(root) {
    const M = window.PlannerModel;
    const model = M.MODELS[root.querySelector("#planner-model").value];
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
      ["Memory per GPU", gb(m.total), "memory"],
      ["Fits in memory", r.fits ? `yes (${(100 * r.memory_fraction).toFixed(0)}%)`
                                : `no (${(100 * r.memory_fraction).toFixed(0)}%)`, "fits"],
      ["Compute per step", seconds(t.compute), "compute"],
      ["Tensor-parallel all-reduces", seconds(t.tensor_parallel), "tensor_parallel"],
      ["Context-parallel K/V exchange (exposed)", seconds(t.context_parallel), "context_parallel"],
      ["Pipeline sends", seconds(t.pipeline_p2p), "pipeline_p2p"],
      ["Pipeline bubble", `${seconds(t.bubble)} (${(100 * r.bubble_fraction).toFixed(1)}%)`, "bubble"],
      ["Data-parallel sync (exposed)", `${seconds(t.data_parallel)} (${seconds(t.data_parallel_exposed)})`, "data_parallel"],
      ["Step time", seconds(t.step), "step"],
      ["Tokens per step", r.tokens_per_step.toLocaleString("en-US"), "tokens_per_step"],
      ["Tokens per second", Math.round(r.tokens_per_s).toLocaleString("en-US"), "tokens_per_s"],
      ["Model FLOPs utilisation (MFU)", (100 * r.model_flops_utilization).toFixed(1) + "%", "model_flops_utilization"],
    ];
    out.innerHTML = "<table><tbody>" + rows.map(
      ([label, value, key]) => `<tr><th>${label}</th><td data-out="${key}">${value}</td></tr>`
    ).join("") + "</tbody></table>";
  }

  function fillCluster(root) {
    const c = window.PlannerModel.CLUSTERS[root.querySelector("#planner-cluster").value];
    for (const [key] of CLUSTER_FIELDS) root.querySelector(`[data-key="${key}"]`).value = c[key];
    fillPeak(root);
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
    fillCluster(root);
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

  if (typeof document$ !== "undefined") document$.subscribe(init);  // Material instant navigation
  else document.addEventListener("DOMContentLoaded", init);
})();
