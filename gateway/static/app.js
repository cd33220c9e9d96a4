// The try-it page. Everything it offers (backends, models, languages, voices, limits) comes
// from /api/config, so a new backend or voice shows up without touching this file.
"use strict";

const KEY_STORAGE = "speech-gateway.api-key";
const CLIP_VOICE = ""; // the Voice choice "upload a reference clip" (no voice is named "")
const STATUS_REFRESH_MS = 5000;
const RECENT_MS = 5 * 60 * 1000;

const $ = (id) => document.getElementById(id);
let config = null;

// --- API access ------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

// fetch() with the key as a Bearer header; a refused request becomes an ApiError with the
// server's message (both error shapes: OpenAI's {"error": {...}} and Sage's {"error": "..."}).
async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (apiKey()) headers.set("Authorization", `Bearer ${apiKey()}`);
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (err) {
    throw new ApiError(0, `The gateway cannot be reached (${err.message}).`);
  }
  if (response.ok) return response;
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = (body.error && (body.error.message || body.error)) || body.detail || message;
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) authFailed(message);
  throw new ApiError(response.status, message);
}

function authFailed(message) {
  const why = apiKey() ? "The API key was refused" : "This server needs an API key";
  showAlert(`${why} (${message}). Enter a valid key above and press Save.`);
}

function showAlert(text) {
  $("alert").textContent = text;
  $("alert").hidden = false;
}

function hideAlert() {
  $("alert").hidden = true;
}

// The Sage status endpoint: position while queued, the full result when done.
async function taskStatus(taskId) {
  const response = await api(`/api/status?task_id=${encodeURIComponent(taskId)}`);
  return response.json();
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// Polls until SUCCEEDED or FAILED (a cancelled task reads FAILED), reporting each reply.
async function waitTerminal(taskId, onState) {
  let delay = 300;
  for (;;) {
    const reply = await taskStatus(taskId);
    onState(reply);
    if (reply.status === "SUCCEEDED" || reply.status === "FAILED") return reply;
    await sleep(delay);
    delay = Math.min(2000, delay * 1.5);
  }
}

function stateText(reply) {
  switch (reply.status) {
    case "PENDING":
      if (reply.queue_position === 0) return "Starting…";
      return reply.queue_position ? `Queued, position ${reply.queue_position}` : "Queued";
    case "RUNNING":
      return "Running…";
    case "SUCCEEDED":
      return "Done";
    default:
      return `Failed: ${reply.error || "the task failed"}`;
  }
}

// --- small helpers ---------------------------------------------------------------------

function fillSelect(select, items, selected) {
  select.replaceChildren(...items.map(([value, text]) =>
    new Option(text, value, value === selected, value === selected)));
}

let languageNames = null;
try {
  languageNames = new Intl.DisplayNames(["en"], { type: "language" });
} catch {
  // an old browser: codes only
}

function languageLabel(code) {
  try {
    const name = languageNames && languageNames.of(code);
    if (name && name.toLowerCase() !== code) return `${name} (${code})`;
  } catch {
    // a code Intl does not know
  }
  return code;
}

// The form of a view, or the note saying why it is not there.
function showForm(kind, available, why = "") {
  $(`${kind}-form`).hidden = !available;
  $(`${kind}-none`).hidden = available;
  $(`${kind}-none`).textContent = why;
}

function backendsOfKind(kind) {
  return Object.entries(config.backends).filter(([, info]) => info.kind === kind);
}

function clock(seconds, decimal = ".", hours = true) {
  const millis = Math.max(0, Math.round(seconds * 1000));
  const h = Math.floor(millis / 3600000);
  const m = Math.floor(millis / 60000) % 60;
  const s = Math.floor(millis / 1000) % 60;
  const ms = millis % 1000;
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  const head = hours || h ? `${pad(h)}:` : "";
  return `${head}${pad(m)}:${pad(s)}${decimal}${pad(ms, 3)}`;
}

function saveFile(name, type, text) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// --- tabs ------------------------------------------------------------------------------

const tabs = () => [...document.querySelectorAll('[role="tab"]')];

function showView(name, focus = false) {
  for (const tab of tabs()) {
    const selected = tab.dataset.view === name;
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !selected;
    if (selected && focus) tab.focus();
  }
  if (location.hash.slice(1) !== name) history.replaceState(null, "", `#${name}`);
  if (name === "status") refreshStatus();
}

function setUpTabs() {
  for (const tab of tabs()) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
    tab.addEventListener("keydown", (event) => {
      const visible = tabs().filter((t) => !t.hidden);
      const at = visible.indexOf(tab);
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      let next = null;
      if (step) next = visible[(at + step + visible.length) % visible.length];
      if (event.key === "Home") next = visible[0];
      if (event.key === "End") next = visible[visible.length - 1];
      if (next) {
        event.preventDefault();
        showView(next.dataset.view, true);
      }
    });
  }
  const wanted = location.hash.slice(1);
  showView(tabs().some((t) => t.dataset.view === wanted) ? wanted : "transcribe");
}

// --- API key ---------------------------------------------------------------------------

function setUpKey() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    localStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    hideAlert();
    loadConfig();
  });
  $("key-clear").addEventListener("click", () => {
    localStorage.removeItem(KEY_STORAGE);
    $("api-key").value = "";
    hideAlert();
    loadConfig();
  });
}

async function loadConfig() {
  try {
    config = await (await api("/api/config")).json();
  } catch (err) {
    if (err.status !== 401) showAlert(`Cannot load the configuration: ${err.message}`);
    const why = err.status === 401 ? "Enter a valid API key above to start."
      : "The configuration could not be loaded.";
    for (const kind of ["asr", "tts"]) showForm(kind, false, why);
    return;
  }
  setUpTranscribe();
  setUpSpeak();
  const current = location.hash.slice(1);
  const shown = tabs().find((t) => t.dataset.view === current && !t.hidden);
  if (!shown) showView("transcribe");
}

// --- Transcribe ------------------------------------------------------------------------

const asr = { file: null, url: null, result: null, stopAt: null, recorder: null };

function setUpTranscribe() {
  const backends = backendsOfKind("asr");
  showForm("asr", backends.length > 0, "No transcription backend is enabled on this server.");
  if (!backends.length) return;
  const previous = $("asr-backend").value;
  const names = backends.map(([name]) => name);
  fillSelect($("asr-backend"), names.map((n) => [n, n]),
    names.includes(previous) ? previous : names[0]);
  asrBackendChanged();
}

function asrBackendChanged() {
  const info = config.backends[$("asr-backend").value];
  fillSelect($("asr-model"), info.models.map((m) => [m, m]), info.default_model);
  const languages = info.languages || [];
  const previous = $("asr-language").value || "auto";
  const items = [["auto", "Detect automatically"], ...languages.map((c) => [c, languageLabel(c)])];
  fillSelect($("asr-language"), items, languages.includes(previous) ? previous : "auto");
  $("asr-words-row").hidden = !info.word_timestamps;
  $("asr-diarize-row").hidden = !info.diarization;
  if (!info.word_timestamps) $("asr-words").checked = false;
  if (!info.diarization) $("asr-diarize").checked = false;
}

function chooseAudio(file, label) {
  if (asr.url) URL.revokeObjectURL(asr.url);
  asr.file = file;
  asr.url = URL.createObjectURL(file);
  const mib = (file.size / 1048576).toFixed(2);
  $("asr-source").textContent = `${label}: ${file.name} (${mib} MiB)`;
  const limit = config && config.limits && config.limits.max_upload_mib;
  if (limit && file.size > limit * 1048576) {
    $("asr-source").textContent += `, over this server's limit of ${limit} MiB`;
  }
}

function setUpAudioInput() {
  $("asr-file").addEventListener("change", () => {
    const file = $("asr-file").files[0];
    if (file) chooseAudio(file, "File");
  });
  // a file dropped beside the zone would make the browser leave the page to show it
  for (const type of ["dragover", "drop"]) window.addEventListener(type, (e) => e.preventDefault());
  const drop = $("drop");
  drop.addEventListener("dragover", (event) => {
    event.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    const file = event.dataTransfer.files[0];
    if (file) chooseAudio(file, "Dropped file");
  });
  const record = $("record");
  if (!(navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.MediaRecorder)) {
    // browsers offer the microphone only on https:// or localhost pages
    record.disabled = true;
    record.textContent = "Recording needs https:// or localhost";
    return;
  }
  record.addEventListener("click", toggleRecording);
}

async function toggleRecording() {
  const record = $("record");
  if (asr.recorder) {
    asr.recorder.stop();
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    $("asr-source").textContent = `The microphone is not available (${err.message}).`;
    return;
  }
  const chunks = [];
  const recorder = new MediaRecorder(stream);
  const started = Date.now();
  const timer = setInterval(() => {
    $("asr-source").textContent = `Recording… ${((Date.now() - started) / 1000).toFixed(0)} s`;
  }, 500);
  recorder.addEventListener("dataavailable", (event) => {
    if (event.data.size) chunks.push(event.data);
  });
  recorder.addEventListener("stop", () => {
    clearInterval(timer);
    stream.getTracks().forEach((track) => track.stop());
    const type = (recorder.mimeType || "audio/webm").split(";")[0];
    const extension = type.includes("ogg") ? "ogg" : type.includes("mp4") ? "m4a" : "webm";
    const blob = new Blob(chunks, { type });
    chooseAudio(new File([blob], `recording.${extension}`, { type }), "Recording");
    asr.recorder = null;
    record.textContent = "Record from the microphone";
    record.setAttribute("aria-pressed", "false");
  });
  asr.recorder = recorder;
  recorder.start(250);
  record.textContent = "Stop recording";
  record.setAttribute("aria-pressed", "true");
  $("asr-source").textContent = "Recording…";
}

// Server-sent events from a fetch() body (EventSource can send neither a POST nor a header).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trim()).join("\n");
      if (data) yield JSON.parse(data);
    }
  }
}

// One submission: the OpenAI route with stream=true, whose events carry each segment as the
// worker produces it; its x-task-id lets the Sage status endpoint tell the queue position
// meanwhile, and the full result (timestamps, speakers, words) once it is done.
async function transcribe(event) {
  event.preventDefault();
  if (!asr.file) {
    setAsrState("Choose a file or record some audio first.");
    return;
  }
  const backend = $("asr-backend").value;
  const form = new FormData();
  form.append("file", asr.file, asr.file.name);
  form.append("model", `${backend}/${$("asr-model").value}`);
  if ($("asr-language").value !== "auto") form.append("language", $("asr-language").value);
  form.append("timestamp_granularities[]", "segment");
  if ($("asr-words").checked) form.append("timestamp_granularities[]", "word");
  if ($("asr-diarize").checked) form.append("diarize", "true");
  form.append("stream", "true");
  form.append("response_format", "json");

  $("asr-go").disabled = true;
  $("asr-result").hidden = false;
  $("downloads").hidden = true;
  $("segments").replaceChildren();
  $("asr-audio").src = asr.url;
  asr.result = null;
  const started = performance.now();
  setAsrState("Uploading…");
  try {
    const response = await api("/v1/audio/transcriptions", { method: "POST", body: form });
    const taskId = response.headers.get("x-task-id");
    let running = false;
    let streamed = false;
    setAsrState("Queued");
    const watch = (async () => {
      while (!running && !streamed) {
        const reply = await taskStatus(taskId);
        if (reply.status !== "PENDING") running = true;
        if (!streamed && reply.status !== "SUCCEEDED" && reply.status !== "FAILED") {
          setAsrState(stateText(reply));
        }
        await sleep(400);
      }
    })().catch(() => {}); // only a progress display: the stream and the final poll decide
    for await (const item of sseEvents(response)) {
      if (item.type === "transcript.text.delta") {
        running = true;
        setAsrState("Running…");
        addLiveSegment(item.delta);
      } else if (item.type === "error" && item.error.code !== "task_timeout") {
        break; // the final status has the error
      }
    }
    streamed = true;
    await watch;
    const final = await waitTerminal(taskId, (reply) => setAsrState(stateText(reply)));
    if (final.status === "SUCCEEDED") {
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      showTranscript(final.result);
      const audio = final.result.duration ? `${final.result.duration.toFixed(1)} s of audio` : "";
      setAsrState(`Done in ${seconds} s${audio ? `: ${audio}` : ""}, ` +
        `${final.result.segments.length} segments.`);
    }
  } catch (err) {
    setAsrState(`Failed: ${err.message}`);
  } finally {
    $("asr-go").disabled = false;
  }
}

function setAsrState(text) {
  $("asr-state").textContent = text;
}

function addLiveSegment(text) {
  const item = document.createElement("li");
  item.className = "live";
  item.textContent = text.trim();
  $("segments").append(item);
}

function showTranscript(result) {
  asr.result = result;
  const items = result.segments.map((segment) => {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.className = "segment";
    const time = document.createElement("span");
    time.className = "time";
    time.textContent = `${clock(segment.start, ".", false)} – ${clock(segment.end, ".", false)}`;
    button.append(time);
    if (segment.speaker !== null && segment.speaker !== undefined && segment.speaker !== "") {
      const speaker = document.createElement("span");
      speaker.className = "speaker";
      speaker.textContent = speakerName(segment.speaker);
      button.append(speaker);
    }
    const text = document.createElement("span");
    text.className = "text";
    text.textContent = segment.text.trim();
    button.append(text);
    button.addEventListener("click", () => playSegment(segment, button));
    item.append(button);
    return item;
  });
  $("segments").replaceChildren(...items);
  $("downloads").hidden = false;
}

function speakerName(speaker) {
  return /^\d+$/.test(String(speaker)) ? `Speaker ${Number(speaker) + 1}` : String(speaker);
}

function playSegment(segment, button) {
  const audio = $("asr-audio");
  for (const other of document.querySelectorAll(".segment[aria-current]")) {
    other.removeAttribute("aria-current");
  }
  button.setAttribute("aria-current", "true");
  asr.stopAt = segment.end;
  audio.currentTime = segment.start;
  audio.play().catch((err) => setAsrState(`Cannot play the audio here (${err.message}).`));
}

function setUpPlayback() {
  const audio = $("asr-audio");
  audio.addEventListener("timeupdate", () => {
    if (asr.stopAt !== null && audio.currentTime >= asr.stopAt) {
      audio.pause();
      asr.stopAt = null;
    }
  });
  audio.addEventListener("seeking", () => {
    if (audio.paused) asr.stopAt = null; // the user moved the slider: play on freely
  });
}

function cueText(segment) {
  const text = segment.text.trim().split(/\s+/).join(" ");
  const speaker = segment.speaker ?? "";
  return speaker === "" ? text : `${speakerName(speaker)}: ${text}`;
}

const RENDER = {
  txt: (result) => result.segments.map(cueText).join("\n") + "\n",
  srt: (result) => result.segments.map((s, i) =>
    `${i + 1}\n${clock(s.start, ",")} --> ${clock(s.end, ",")}\n${cueText(s)}\n`).join("\n"),
  vtt: (result) => ["WEBVTT\n", ...result.segments.map((s) =>
    `${clock(s.start)} --> ${clock(s.end)}\n${cueText(s).replaceAll("-->", "->")}\n`)]
    .join("\n"),
  json: (result) => JSON.stringify(result, null, 2) + "\n",
};
const MEDIA_TYPES = { txt: "text/plain", srt: "application/x-subrip", vtt: "text/vtt",
  json: "application/json" };

function setUpDownloads() {
  for (const button of document.querySelectorAll("#downloads button")) {
    button.addEventListener("click", () => {
      if (!asr.result) return;
      const format = button.dataset.format;
      const stem = (asr.file ? asr.file.name : "transcript").replace(/\.[^.]+$/, "");
      saveFile(`${stem}.${format}`, MEDIA_TYPES[format], RENDER[format](asr.result));
    });
  }
}

// --- Speak -----------------------------------------------------------------------------

function setUpSpeak() {
  const backends = backendsOfKind("tts");
  $("tab-speak").hidden = backends.length === 0;
  showForm("tts", backends.length > 0, "No speech backend is enabled on this server.");
  if (!backends.length) return;
  const tts = config.tts || {};
  const names = backends.map(([name]) => name);
  fillSelect($("tts-backend"), names.map((n) => [n, n]), names[0]);
  ttsBackendChanged();
  const voices = (tts.voices || []).map((v) => [v, v]);
  fillSelect($("tts-voice"), [...voices, [CLIP_VOICE, "Upload a reference clip…"]],
    tts.default_voice || (voices[0] || [CLIP_VOICE])[0]);
  voiceChanged();
  if (tts.min_reference_seconds) {
    $("tts-clip-hint").textContent =
      `At least ${tts.min_reference_seconds} s of one speaker; 5–30 s of clean speech works best.`;
  }
  const speed = tts.speed || { min: 0.25, max: 4, default: 1 };
  Object.assign($("tts-speed"), { min: speed.min, max: speed.max, step: 0.05 });
  $("tts-speed").value = speed.default;
  speedChanged();
  if (tts.max_characters) $("tts-text").maxLength = tts.max_characters;
  countCharacters();
}

function ttsBackendChanged() {
  const info = config.backends[$("tts-backend").value];
  fillSelect($("tts-model"), info.models.map((m) => [m, m]), info.default_model);
  const languages = info.languages || [];
  const previous = $("tts-language").value;
  const fallback = languages.includes("en") ? "en" : languages[0];
  fillSelect($("tts-language"), languages.map((c) => [c, languageLabel(c)]),
    languages.includes(previous) ? previous : fallback);
}

function voiceChanged() {
  const clip = $("tts-voice").value === CLIP_VOICE;
  $("tts-clip-row").hidden = !clip;
  $("tts-clip").required = clip;
}

function speedChanged() {
  $("tts-speed-value").textContent = `${Number($("tts-speed").value).toFixed(2)}×`;
}

function countCharacters() {
  const max = config && config.tts && config.tts.max_characters;
  const used = $("tts-text").value.length;
  $("tts-count").textContent = max ? `${used} / ${max} characters` : `${used} characters`;
}

async function speak(event) {
  event.preventDefault();
  const form = new FormData();
  form.append("text", $("tts-text").value);
  form.append("model", $("tts-model").value);
  form.append("language", $("tts-language").value);
  form.append("speed", $("tts-speed").value);
  if ($("tts-voice").value === CLIP_VOICE) {
    form.append("speaker_wav", $("tts-clip").files[0]);
  } else {
    form.append("voice", $("tts-voice").value);
  }
  $("tts-go").disabled = true;
  $("tts-result").hidden = true;
  $("tts-state").textContent = "Sending…";
  const started = performance.now();
  try {
    const backend = encodeURIComponent($("tts-backend").value);
    const submitted = await (await api(`/api/${backend}-submit`, { method: "POST", body: form }))
      .json();
    const final = await waitTerminal(submitted.task_id, (reply) => {
      $("tts-state").textContent = stateText(reply);
    });
    if (final.status === "SUCCEEDED") {
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      const length = final.usage && final.usage.audio_seconds;
      $("tts-audio").src = final.output_url;
      $("tts-download").href = final.output_url;
      $("tts-download").download = `speech-${submitted.task_id}.wav`;
      $("tts-result").hidden = false;
      $("tts-state").textContent =
        `Done in ${seconds} s${length ? `: ${length.toFixed(2)} s of audio` : ""}.`;
    }
  } catch (err) {
    $("tts-state").textContent = `Failed: ${err.message}`;
  } finally {
    $("tts-go").disabled = false;
  }
}

// --- Status ----------------------------------------------------------------------------

const snapshots = []; // [time, histograms] of the refreshes of the last 5 minutes

// Prometheus text -> [{name, labels, value}]
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, key, value] of (match[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
      labels[key] = value;
    }
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

// {backend: {metric: {count, sum, buckets: [[le, cumulative count]]}}}
function histograms(samples) {
  const found = {};
  for (const { name, labels, value } of samples) {
    const match = /^speech_(\w+?)_(bucket|sum|count)$/.exec(name);
    if (!match || !labels.backend) continue;
    const backend = (found[labels.backend] ||= {});
    const metric = (backend[match[1]] ||= { count: 0, sum: 0, buckets: [] });
    if (match[2] === "bucket") metric.buckets.push([Number(labels.le), value]);
    else metric[match[2]] = value;
  }
  return found;
}

function summary(now, before) {
  const count = now.count - (before ? before.count : 0);
  if (count <= 0) return null;
  const sum = now.sum - (before ? before.sum : 0);
  let p95 = Infinity;
  for (const [le, cumulative] of now.buckets) {
    const earlier = before ? (before.buckets.find((b) => b[0] === le) || [0, 0])[1] : 0;
    if (cumulative - earlier >= 0.95 * count) {
      p95 = le;
      break;
    }
  }
  return { count, mean: sum / count, p95 };
}

function latencyText(stats) {
  if (!stats) return "no tasks";
  const p95 = Number.isFinite(stats.p95) ? `≤ ${stats.p95}\u00a0s` : "over the largest bucket";
  return `${stats.count} tasks, mean ${stats.mean.toFixed(2)}\u00a0s, p95 ${p95}`;
}

function gauge(samples, name, backend) {
  const sample = samples.find((s) => s.name === name && s.labels.backend === backend);
  return sample ? sample.value : 0;
}

function tasksCount(samples, backend, outcome) {
  const sample = samples.find((s) => s.name === "speech_tasks_total"
    && s.labels.backend === backend && s.labels.outcome === outcome);
  return sample ? sample.value : 0;
}

async function refreshStatus() {
  let ready;
  try {
    const response = await fetch("/ready"); // public: the workers show even without a key
    ready = await response.json();
  } catch (err) {
    $("status-note").textContent = `The gateway cannot be reached (${err.message}).`;
    $("status-note").hidden = false;
    return;
  }
  let samples = null;
  try {
    samples = parseMetrics(await (await api("/metrics")).text());
    $("status-note").hidden = true;
  } catch (err) {
    $("status-note").textContent = err.status === 401
      ? "Queue depths and latencies need a valid API key."
      : `Metrics are unavailable (${err.message}).`;
    $("status-note").hidden = false;
  }
  const now = Date.now();
  let before = null;
  if (samples) {
    const current = histograms(samples);
    while (snapshots.length > 1 && now - snapshots[1][0] >= RECENT_MS) snapshots.shift();
    before = snapshots.length ? snapshots[0] : null;
    snapshots.push([now, current]);
    samples.histograms = current;
  }
  renderStatus(ready, samples, before);
  $("status-time").textContent = `Last update ${new Date(now).toLocaleTimeString()}.`;
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function renderStatus(ready, samples, before) {
  const cards = [];
  if (!ready.redis) {
    cards.push(element("p", "Redis is not reachable: nothing can be queued.", "note"));
  }
  for (const [backend, entry] of Object.entries(ready.backends || {})) {
    const card = element("article", undefined, "card");
    const title = element("h2", backend);
    const badge = element("span", entry.workers ? `${entry.workers} live` : "no live worker",
      entry.workers ? "badge ok" : "badge bad");
    title.append(" ", badge);
    card.append(title);
    const facts = element("dl");
    const add = (term, value) => facts.append(element("dt", term), element("dd", value));
    if (samples) {
      add("Queue", `${gauge(samples, "speech_queue_waiting", backend)} waiting, ` +
        `${gauge(samples, "speech_queue_pending", backend)} running`);
      add("Tasks", `${tasksCount(samples, backend, "SUCCEEDED")} succeeded, ` +
        `${tasksCount(samples, backend, "FAILED")} failed`);
      // "recent": tasks finished since the oldest refresh of the last 5 minutes
      const mine = samples.histograms[backend] || {};
      const earlier = (before && before[1][backend]) || {};
      const since = before && new Date(before[0]).toLocaleTimeString();
      for (const [metric, label] of [["end_to_end_seconds", "End to end"],
        ["queue_wait_seconds", "Queue wait"]]) {
        if (!mine[metric]) continue;
        if (before) {
          add(`${label} since ${since}`, latencyText(summary(mine[metric], earlier[metric])));
        }
        add(`${label}, all`, latencyText(summary(mine[metric], null)));
      }
    }
    const breakers = Object.entries(entry.breakers || {})
      .filter(([, b]) => b && b.state && b.state !== "closed");
    for (const [model, breaker] of breakers) add(`Model ${model}`, `breaker ${breaker.state}`);
    card.append(facts);
    const workers = element("ul", undefined, "workers");
    for (const worker of entry.live || []) {
      const models = (worker.loaded_models || []).join(", ") || "no model loaded";
      const item = element("li");
      item.append(element("span", worker.consumer, "consumer"), " ",
        element("span", worker.state || "?", `badge state-${worker.state}`), " ",
        element("span", models));
      workers.append(item);
    }
    if (entry.live && entry.live.length) card.append(element("h3", "Workers"), workers);
    cards.push(card);
  }
  $("status-body").replaceChildren(...cards);
}

function setUpStatus() {
  setInterval(() => {
    if (!document.hidden && !$("view-status").hidden) refreshStatus();
  }, STATUS_REFRESH_MS);
}

// --- start -----------------------------------------------------------------------------

function start() {
  setUpKey();
  setUpTabs();
  setUpAudioInput();
  setUpPlayback();
  setUpDownloads();
  setUpStatus();
  $("asr-backend").addEventListener("change", asrBackendChanged);
  $("asr-form").addEventListener("submit", transcribe);
  $("tts-backend").addEventListener("change", ttsBackendChanged);
  $("tts-voice").addEventListener("change", voiceChanged);
  $("tts-speed").addEventListener("input", speedChanged);
  $("tts-text").addEventListener("input", countCharacters);
  $("tts-form").addEventListener("submit", speak);
  loadConfig();
}

start();
