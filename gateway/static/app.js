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
  setUpVoices(); // voices.js
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

// --- Transcribe live -------------------------------------------------------------------
// The microphone over /v1/realtime (the OpenAI Realtime transcription protocol): PCM16 at
// LIVE_RATE, base64, an input_audio_buffer.append every ~100 ms; the server's VAD cuts turns
// and each turn's transcript comes back as deltas, then one completed (or failed) event.

const LIVE_RATE = 24000; // the protocol's default; 16000 is the other rate it takes
const LIVE_DRAIN_MS = 60000; // after Stop, how long to wait for the turns still being transcribed
const live = { socket: null, context: null, stream: null, configured: false, turns: new Map(),
  stopping: false, speaking: false, awaitingCommit: false, drainTimer: null, error: "" };

function setUpLive() {
  for (const radio of document.querySelectorAll('[name="asr-mode"]')) {
    radio.addEventListener("change", modeChanged);
  }
  const go = $("live-go");
  if (!(navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.AudioWorkletNode)) {
    go.disabled = true;
    go.textContent = "Live transcription needs https:// or localhost";
    return;
  }
  go.addEventListener("click", () => (live.socket ? stopLive() : startLive()));
}

function modeChanged() {
  const isLive = $("mode-live").checked;
  for (const id of ["drop", "asr-checks", "asr-go"]) $(id).hidden = isLive;
  $("live").hidden = !isLive;
  $("turns").hidden = !isLive;
  $("asr-result").hidden = isLive || !asr.result;
  setAsrState("");
}

// Controls that would change the session under way are locked while it runs.
function lockLive(locked) {
  for (const id of ["mode-file", "mode-live", "asr-backend", "asr-model", "asr-language"]) {
    $(id).disabled = locked;
  }
  $("live-go").textContent = locked ? "Stop" : "Start live transcription";
  $("live-go").setAttribute("aria-pressed", String(locked));
}

function setSpeech(text, on = false) {
  $("live-speech").textContent = text;
  $("live-speech").className = on ? "badge ok" : "badge";
}

async function startLive() {
  lockLive(true);
  $("live-go").disabled = true; // until the microphone is on the air, or it failed
  live.error = "";
  live.turns.clear();
  $("turns").replaceChildren();
  setAsrState("Opening the microphone…");
  try {
    // made in the click's task: a page may start audio only on a user gesture
    live.context = new AudioContext();
    live.stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    await live.context.audioWorklet.addModule("/static/capture.js");
  } catch (err) {
    setAsrState(`The microphone is not available (${err.message}).`);
    endLive();
    return;
  }
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  // a browser cannot set headers on a WebSocket: a short-lived key minted for this session
  // (POST /v1/realtime/client_secrets, it opens nothing else) travels as a subprotocol, so
  // the API key itself never goes into the socket's handshake
  let secret;
  try {
    const minted = await api("/v1/realtime/client_secrets", { method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ expires_after: { anchor: "created_at", seconds: 60 },
        session: { type: "transcription" } }) });
    secret = (await minted.json()).value;
  } catch (err) {
    setAsrState(err.status === 401 ? "The key was refused." : `Cannot connect: ${err.message}`);
    endLive();
    return;
  }
  const protocols = ["realtime", `openai-insecure-api-key.${secret}`];
  let socket;
  try {
    socket = new WebSocket(`${scheme}://${location.host}/v1/realtime?intent=transcription`,
      protocols);
  } catch (err) {
    setAsrState(`Cannot connect: ${err.message}`);
    endLive();
    return;
  }
  live.socket = socket;
  // events of an earlier session (closing while a new one starts) are ignored
  socket.addEventListener("message", (message) => {
    if (socket === live.socket) liveEvent(JSON.parse(message.data));
  });
  socket.addEventListener("close", (event) => {
    if (socket !== live.socket) return;
    if (event.code === 1008) {
      authFailed(event.reason || "refused");
      setAsrState("The key was refused.");
    } else {
      setAsrState(`The session ended: ${live.error || `connection closed (${event.code})`}`);
    }
    endLive();
  });
  setAsrState("Connecting…");
}

function sendLive(event) {
  if (live.socket && live.socket.readyState === WebSocket.OPEN) {
    live.socket.send(JSON.stringify(event));
  }
}

function liveEvent(event) {
  switch (event.type) {
    case "session.created": {
      const language = $("asr-language").value;
      sendLive({ type: "session.update", session: { type: "transcription", audio: { input: {
        format: { type: "audio/pcm", rate: LIVE_RATE },
        transcription: { model: `${$("asr-backend").value}/${$("asr-model").value}`,
          language: language === "auto" ? null : language },
        turn_detection: { type: "server_vad", silence_duration_ms: 500 },
      } } } });
      break;
    }
    case "session.updated":
      if (!live.configured) startCapture();
      live.configured = true;
      break;
    case "input_audio_buffer.speech_started":
      live.speaking = true;
      setSpeech("speech", true);
      break;
    case "input_audio_buffer.speech_stopped":
      live.speaking = false;
      setSpeech("silence");
      break;
    case "input_audio_buffer.committed":
      live.awaitingCommit = false;
      addTurn(event.item_id);
      break;
    case "conversation.item.input_audio_transcription.delta":
      turnText(event.item_id, event.delta, "pending", true);
      break;
    case "conversation.item.input_audio_transcription.completed":
      turnText(event.item_id, event.transcript.trim() || "(nothing heard)", "done");
      break;
    case "conversation.item.input_audio_transcription.failed":
      turnText(event.item_id, `Failed: ${event.error.message}`, "failed");
      break;
    case "error":
      if (event.error.code === "input_audio_buffer_commit_empty") {
        live.awaitingCommit = false; // the speech under way was too short to be a turn
      } else if (!live.configured) {
        closeLive(`Failed: ${event.error.message}`); // e.g. the model was refused
      } else {
        live.error = event.error.message; // the session goes on, unless a close follows
        setAsrState(`Error: ${event.error.message}`);
      }
      break;
    default:
      break; // conversation.item.added/done, input_audio_buffer.cleared
  }
  if (live.stopping) finishLive();
}

function startCapture() {
  const context = live.context;
  const source = context.createMediaStreamSource(live.stream);
  const node = new AudioWorkletNode(context, "capture");
  const resample = downsampler(context.sampleRate, LIVE_RATE);
  node.port.onmessage = ({ data }) => {
    sendLive({ type: "input_audio_buffer.append", audio: pcm16Base64(resample(data)) });
  };
  source.connect(node);
  node.connect(context.destination); // silent (it writes no output), but keeps it processing
  context.resume();
  $("live-go").disabled = false;
  setSpeech("silence");
  setAsrState("Listening: speak, and pause to end a turn.");
}

function addTurn(itemId) {
  const item = element("li", "", "turn pending");
  live.turns.set(itemId, item);
  $("turns").append(item); // committed in order; they may complete out of order
}

function turnText(itemId, text, state, append = false) {
  const item = live.turns.get(itemId);
  if (!item) return;
  item.textContent = append ? item.textContent + text : text;
  item.className = `turn ${state}`;
}

// Stop: close the microphone, commit the speech under way, let the turns finish, then close.
function stopLive() {
  live.stopping = true;
  $("live-go").disabled = true;
  stopCapture();
  if (live.speaking) {
    live.awaitingCommit = true;
    sendLive({ type: "input_audio_buffer.commit" });
  }
  setAsrState("Finishing the last turns…");
  live.drainTimer = setTimeout(() => closeLive("Stopped before the last turns finished."),
    LIVE_DRAIN_MS);
  finishLive();
}

function finishLive() {
  const waiting = [...live.turns.values()].some((item) => item.classList.contains("pending"));
  const count = live.turns.size;
  if (live.awaitingCommit || waiting) return;
  closeLive(`Stopped: ${count} turn${count === 1 ? "" : "s"}.`);
}

function closeLive(text) {
  setAsrState(text);
  if (live.socket) live.socket.close(1000);
  endLive();
}

function stopCapture() {
  if (live.stream) live.stream.getTracks().forEach((track) => track.stop());
  if (live.context) live.context.close().catch(() => {});
  Object.assign(live, { stream: null, context: null });
}

function endLive() {
  stopCapture();
  clearTimeout(live.drainTimer);
  Object.assign(live, { socket: null, configured: false, stopping: false, speaking: false,
    awaitingCommit: false });
  $("live-go").disabled = false;
  for (const item of $("turns").querySelectorAll(".pending")) {
    item.textContent = "(not finished)";
    item.className = "turn failed";
  }
  setSpeech("not listening");
  lockLive(false);
}

// Downsampling by averaging the input samples each output sample covers (a box filter: enough
// against aliasing for speech at 44.1 or 48 kHz to 24 kHz); the remainder carries over.
function downsampler(from, to) {
  const step = from / to;
  let rest = new Float32Array(0);
  let position = 0;
  return (input) => {
    const data = new Float32Array(rest.length + input.length);
    data.set(rest);
    data.set(input, rest.length);
    const out = new Float32Array(Math.max(0, Math.floor((data.length - position) / step)));
    for (let i = 0; i < out.length; i += 1, position += step) {
      const first = Math.floor(position);
      const end = Math.max(first + 1, Math.floor(position + step));
      let sum = 0;
      for (let j = first; j < end; j += 1) sum += data[j];
      out[i] = sum / (end - first);
    }
    const used = Math.min(Math.floor(position), data.length);
    rest = data.slice(used);
    position -= used;
    return out;
  };
}

function pcm16Base64(samples) {
  const bytes = new DataView(new ArrayBuffer(samples.length * 2));
  samples.forEach((s, i) => bytes.setInt16(i * 2, Math.max(-1, Math.min(1, s)) * 0x7fff, true));
  let text = "";
  const view = new Uint8Array(bytes.buffer);
  for (let i = 0; i < view.length; i += 0x8000) {
    text += String.fromCharCode(...view.subarray(i, i + 0x8000));
  }
  return btoa(text);
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
  $("tts-stream-row").hidden = clip; // an uploaded clip goes the Sage way: spoken whole
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
  $("tts-go").disabled = true;
  $("tts-result").hidden = true;
  $("tts-state").textContent = "Sending…";
  delete $("tts-state").dataset.firstAudio;
  delete $("tts-state").dataset.played;
  const started = performance.now();
  try {
    if (streamChosen()) await speakStreamed(started);
    else await speakWhole(started);
  } catch (err) {
    $("tts-state").textContent = `Failed: ${err.message}`;
  } finally {
    $("tts-go").disabled = false;
  }
}

// A reference clip is an upload, which only the Sage route takes: that path is never streamed.
function streamChosen() {
  return $("tts-stream").checked && $("tts-voice").value !== CLIP_VOICE;
}

function showSpeech(url, taskId) {
  $("tts-audio").src = url;
  $("tts-download").href = url;
  $("tts-download").download = `speech-${taskId}.wav`;
  $("tts-result").hidden = false;
}

// The whole file: the Sage submit (it takes an uploaded clip), polled until it is done.
async function speakWhole(started) {
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
  const backend = encodeURIComponent($("tts-backend").value);
  const submitted = await (await api(`/api/${backend}-submit`, { method: "POST", body: form }))
    .json();
  const final = await waitTerminal(submitted.task_id, (reply) => {
    $("tts-state").textContent = stateText(reply);
  });
  if (final.status !== "SUCCEEDED") return;
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  const length = final.usage && final.usage.audio_seconds;
  showSpeech(final.output_url, submitted.task_id);
  $("tts-state").textContent =
    `Done in ${seconds} s${length ? `: ${length.toFixed(2)} s of audio` : ""}.`;
}

// Streamed speech: /v1/audio/speech with stream_format "sse" and response_format "wav", whose
// first bytes are a WAV header (its sizes "unknown") and the rest PCM16 samples, each sentence
// as soon as it is spoken; every piece is scheduled right after the one before.
async function speakStreamed(started) {
  const player = new StreamPlayer(); // made in the click's task: audio may start only on a gesture
  const body = {
    model: `${$("tts-backend").value}/${$("tts-model").value}`, input: $("tts-text").value,
    voice: $("tts-voice").value, language: $("tts-language").value,
    speed: Number($("tts-speed").value), response_format: "wav", stream_format: "sse",
  };
  try {
    const response = await api("/v1/audio/speech", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" } });
    $("tts-state").textContent = "Speaking…";
    let firstAudio = null;
    let finished = false;
    for await (const event of sseEvents(response)) {
      if (event.type === "speech.audio.delta") {
        player.push(Uint8Array.from(atob(event.audio), (c) => c.charCodeAt(0)));
        if (firstAudio === null && player.scheduled) {
          firstAudio = (performance.now() - started) / 1000;
          $("tts-state").dataset.firstAudio = firstAudio.toFixed(3);
        }
        if (firstAudio !== null) {
          $("tts-state").textContent = `Playing: first audio after ${firstAudio.toFixed(2)} s, ` +
            `${player.seconds().toFixed(1)} s received…`;
        }
      } else if (event.type === "speech.audio.done") {
        finished = true;
      } else if (event.type === "error") {
        throw new Error(event.error.message);
      }
    }
    if (!finished) throw new Error("the stream ended before the last sentence");
    await player.drained();
    const url = response.headers.get("x-output-url");
    if (url) showSpeech(url, response.headers.get("x-task-id"));
    $("tts-state").dataset.played = String(player.played);
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    $("tts-state").textContent = `Done in ${seconds} s: first audio after ` +
      `${firstAudio.toFixed(2)} s, ${player.seconds().toFixed(2)} s of audio played.`;
  } finally {
    player.close();
  }
}

class StreamPlayer {
  constructor() {
    this.context = new AudioContext();
    this.pending = new Uint8Array(0); // bytes not played yet: the header, or half a sample
    this.rate = 0; // from the header
    this.at = 0; // when the next piece starts, on the context's clock
    this.scheduled = 0; // samples
    this.played = 0;
    this.playing = 0; // sources scheduled and not ended
    this.idle = null;
  }

  push(bytes) {
    const data = new Uint8Array(this.pending.length + bytes.length);
    data.set(this.pending);
    data.set(bytes, this.pending.length);
    let start = 0;
    if (!this.rate) {
      if (data.length < 44) {
        this.pending = data;
        return;
      }
      // gateway/common/stream_audio.py's header: RIFF, fmt (rate at byte 24), then data at 36
      const view = new DataView(data.buffer);
      const tag = (at) => String.fromCharCode(...data.subarray(at, at + 4));
      if (tag(0) !== "RIFF" || tag(36) !== "data") throw new Error("not a streaming WAV");
      this.rate = view.getUint32(24, true);
      start = 44;
    }
    const count = Math.floor((data.length - start) / 2);
    this.pending = data.slice(start + count * 2);
    if (count) this.schedule(new DataView(data.buffer, start, count * 2), count);
  }

  schedule(pcm, count) {
    const buffer = this.context.createBuffer(1, count, this.rate);
    const samples = buffer.getChannelData(0);
    for (let i = 0; i < count; i += 1) samples[i] = pcm.getInt16(i * 2, true) / 32768;
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    // a small lead when the queue ran dry, so the piece is not cut by the scheduling itself
    this.at = Math.max(this.at, this.context.currentTime + 0.05);
    source.start(this.at);
    this.at += buffer.duration;
    this.scheduled += count;
    this.playing += 1;
    source.addEventListener("ended", () => {
      this.played += count;
      this.playing -= 1;
      if (!this.playing && this.idle) this.idle();
    });
  }

  seconds() {
    return this.rate ? this.scheduled / this.rate : 0;
  }

  drained() {
    return this.playing ? new Promise((resolve) => { this.idle = resolve; }) : Promise.resolve();
  }

  close() {
    this.context.close().catch(() => {});
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
  setUpLive();
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

// after every deferred script ran (voices.js comes after this one, and the configuration's
// reply could otherwise arrive before it is there)
document.addEventListener("DOMContentLoaded", start);
