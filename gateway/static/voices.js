// The Voices panel: a consent recording, then a sample of the same speaker, make a custom
// voice (/v1/audio/voice_consents, /v1/audio/voices); the page speaks with it through
// /v1/audio/speech with voice {"id": …}. Uses app.js's $, api and config.
"use strict";

const voicesView = { consent: null, recordings: { consent: null, voice: null }, ready: false };

function setUpVoices() {
  const phrases = (config && config.consent_phrases) || {};
  const speaks = backendsOfKind("tts").length > 0;
  $("tab-voices").hidden = !speaks || !Object.keys(phrases).length;
  if ($("tab-voices").hidden) return;
  const previous = $("consent-language").value;
  fillSelect($("consent-language"), Object.keys(phrases).map((c) => [c, languageLabel(c)]),
    phrases[previous] ? previous : Object.keys(phrases)[0]);
  consentLanguageChanged();
  if (!voicesView.ready) {
    voicesView.ready = true;
    $("consent-language").addEventListener("change", consentLanguageChanged);
    for (const kind of ["consent", "voice"]) {
      setUpRecorder(kind);
      $(`${kind}-file`).addEventListener("change", () => {
        voicesView.recordings[kind] = $(`${kind}-file`).files[0] || null;
        $(`${kind}-state`).textContent = voicesView.recordings[kind] ? "File chosen." : "";
      });
    }
    $("consent-form").addEventListener("submit", sendConsent);
    $("voice-form").addEventListener("submit", createVoice);
  }
  listVoices();
}

function consentLanguageChanged() {
  $("consent-phrase").textContent = config.consent_phrases[$("consent-language").value] || "";
}

// A record button toggles a MediaRecorder; what it recorded replaces any file chosen.
function setUpRecorder(kind) {
  const button = $(`${kind}-record`);
  if (!(navigator.mediaDevices && navigator.mediaDevices.getUserMedia && window.MediaRecorder)) {
    button.disabled = true;
    button.textContent = "Recording needs https:// or localhost";
    return;
  }
  let recorder = null;
  button.addEventListener("click", async () => {
    if (recorder) {
      recorder.stop();
      return;
    }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (err) {
      $(`${kind}-state`).textContent = `The microphone is not available (${err.message}).`;
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (event) => event.data.size && chunks.push(event.data));
    recorder.addEventListener("stop", () => {
      stream.getTracks().forEach((track) => track.stop());
      const type = (recorder.mimeType || "audio/webm").split(";")[0];
      voicesView.recordings[kind] = new File([new Blob(chunks, { type })],
        `${kind}.${type.includes("ogg") ? "ogg" : "webm"}`, { type });
      recorder = null;
      button.textContent = kind === "consent" ? "Record the consent again" : "Record the sample again";
      button.setAttribute("aria-pressed", "false");
      $(`${kind}-state`).textContent = "Recorded.";
    });
    recorder.start(250);
    button.textContent = "Stop recording";
    button.setAttribute("aria-pressed", "true");
    $(`${kind}-state`).textContent = "Recording…";
  });
}

async function sendConsent(event) {
  event.preventDefault();
  const recording = voicesView.recordings.consent;
  if (!recording) {
    $("consent-state").textContent = "Record the consent phrase (or choose a file) first.";
    return;
  }
  const form = new FormData();
  form.append("name", $("consent-name").value);
  form.append("language", $("consent-language").value);
  form.append("recording", recording);
  $("consent-go").disabled = true;
  $("consent-state").textContent = "Checking the recording…";
  try {
    const consent = await (await api("/v1/audio/voice_consents", { method: "POST", body: form }))
      .json();
    voicesView.consent = consent.id;
    $("voice-go").disabled = false;
    $("consent-state").textContent = `Consent recorded (${consent.id}).`;
  } catch (err) {
    $("consent-state").textContent = `Refused: ${err.message}`;
  } finally {
    $("consent-go").disabled = false;
  }
}

async function createVoice(event) {
  event.preventDefault();
  const sample = voicesView.recordings.voice;
  if (!voicesView.consent || !sample) {
    $("voice-state").textContent = "Send a consent, then record a sample (or choose a file).";
    return;
  }
  const form = new FormData();
  form.append("name", $("voice-name").value);
  form.append("consent", voicesView.consent);
  form.append("audio_sample", sample);
  $("voice-go").disabled = true;
  $("voice-state").textContent = "Checking the sample against the consent…";
  try {
    const voice = await (await api("/v1/audio/voices", { method: "POST", body: form })).json();
    $("voice-state").textContent = `Voice created (${voice.id}).`;
    await listVoices();
  } catch (err) {
    $("voice-state").textContent = `Refused: ${err.message}`;
  } finally {
    $("voice-go").disabled = false;
  }
}

async function listVoices() {
  let page;
  try {
    page = await (await api("/v1/audio/voices?limit=100")).json();
  } catch (err) {
    $("voices-state").textContent = `Cannot list the voices: ${err.message}`;
    return;
  }
  const items = page.data.map((voice) => {
    const row = document.createElement("li");
    row.dataset.voice = voice.id;
    const name = element("span", `${voice.name} (${voice.id})`);
    const speakButton = element("button", "Speak", "secondary");
    speakButton.type = "button";
    speakButton.addEventListener("click", () => speakWithVoice(voice.id));
    const remove = element("button", "Delete", "secondary");
    remove.type = "button";
    remove.addEventListener("click", () => deleteVoice(voice.id));
    row.append(name, speakButton, remove);
    return row;
  });
  $("voices-list").replaceChildren(...items);
  $("voices-state").textContent = items.length ? "" : "No voices yet.";
}

async function speakWithVoice(id) {
  $("voices-state").textContent = "Speaking…";
  try {
    const response = await api("/v1/audio/speech", { method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: "tts-1", voice: { id }, input: $("voices-text").value,
        response_format: "wav" }) });
    const audio = $("voices-audio");
    audio.src = URL.createObjectURL(await response.blob());
    audio.hidden = false;
    $("voices-state").textContent = "Spoken.";
  } catch (err) {
    $("voices-state").textContent = `Failed: ${err.message}`;
  }
}

async function deleteVoice(id) {
  try {
    await api(`/v1/audio/voices/${encodeURIComponent(id)}`, { method: "DELETE" });
  } catch (err) {
    $("voices-state").textContent = `Cannot delete: ${err.message}`;
    return;
  }
  await listVoices();
}
