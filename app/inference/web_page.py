"""The generation server's page at `/`: one self-contained HTML document (inline CSS and JS, no
build step, nothing fetched from elsewhere) that sends Megatron's PUT /api request and shows the
completion. Element ids (prompt, tokens, temperature, top_k, top_p, seed, generate, completion,
error, status) are what the page's tests drive."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>GPT-2 text generation</title>
<link rel="icon" href="data:,">
<style>
  body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem;
         color: #1d1d1f; background: #fafafa; }
  h1 { font-size: 1.4rem; }
  textarea { width: 100%; min-height: 8rem; font: 0.95rem ui-monospace, monospace; padding: .5rem;
             box-sizing: border-box; }
  .controls { display: flex; flex-wrap: wrap; gap: .75rem 1.25rem; margin: .75rem 0; }
  label { display: flex; flex-direction: column; font-size: .85rem; color: #444; }
  input { width: 7rem; padding: .25rem; font-size: .95rem; }
  button { padding: .5rem 1.5rem; font-size: 1rem; cursor: pointer; }
  button:disabled { cursor: wait; opacity: .6; }
  pre { white-space: pre-wrap; word-break: break-word; background: #fff; border: 1px solid #ddd;
        padding: .75rem; min-height: 4rem; font: 0.95rem ui-monospace, monospace; }
  .new { background: #e3f1ff; }
  #error { color: #b00020; white-space: pre-wrap; }
  #status { color: #666; font-size: .85rem; margin-left: 1rem; }
  .hint { color: #666; font-size: .8rem; }
</style>
</head>
<body>
<h1>GPT-2 text generation</h1>
<form id="form">
  <textarea id="prompt" placeholder="Type a prompt" required></textarea>
  <div class="controls">
    <label>tokens to generate <input id="tokens" type="number" step="1" value="32"></label>
    <label>temperature <input id="temperature" type="number" step="any" value="1.0"></label>
    <label>top-k <input id="top_k" type="number" step="1" value="0"></label>
    <label>top-p <input id="top_p" type="number" step="any" value="0"></label>
    <label>seed <input id="seed" type="number" step="1" placeholder="none"></label>
  </div>
  <p class="hint">temperature 1, top-k 0, top-p 0 and no seed: greedy decoding. The server
  checks every value and says what is wrong.</p>
  <button id="generate" type="submit">Generate</button><span id="status"></span>
</form>
<h2>Completion</h2>
<pre id="completion"></pre>
<div id="error"></div>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function number(id, parse) {
  const text = $(id).value.trim();
  return text === "" ? null : parse(text);
}
$("form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const body = {prompts: [$("prompt").value], tokens_to_generate: number("tokens", parseInt),
                temperature: number("temperature", parseFloat), top_k: number("top_k", parseInt),
                top_p: number("top_p", parseFloat)};
  const seed = number("seed", parseInt);
  if (seed !== null) body.random_seed = seed;
  $("generate").disabled = true;
  $("error").textContent = "";
  $("status").textContent = "generating\u2026";
  const started = performance.now();
  try {
    const reply = await fetch("api", {method: "PUT", headers: {"Content-Type": "application/json"},
                                      body: JSON.stringify(body)});
    const data = await reply.json();
    if (!reply.ok) throw new Error(data.error || ("HTTP " + reply.status));
    const out = $("completion");
    out.textContent = "";
    out.appendChild(document.createTextNode(body.prompts[0]));
    const added = document.createElement("span");
    added.className = "new";
    added.id = "generated";
    added.textContent = data.generated_text[0];
    out.appendChild(added);
    out.dataset.done = "1";
    const seconds = (performance.now() - started) / 1000;
    $("status").textContent = data.generated_tokens[0].length + " tokens in " +
                              seconds.toFixed(2) + " s";
  } catch (err) {
    $("error").textContent = String(err.message || err);
    $("error").dataset.done = "1";
    $("status").textContent = "";
  } finally {
    $("generate").disabled = false;
  }
});
</script>
</body>
</html>
"""
