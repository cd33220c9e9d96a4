// The try-it page's microphone tap (an AudioWorklet, run on the audio thread): each input
// block downmixed to mono and handed to the page every ~100 ms of audio, at the context's rate.
"use strict";

class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.size = Math.round(sampleRate / 10);
    this.chunk = new Float32Array(this.size);
    this.filled = 0;
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || !channels.length) return true; // no input yet (or it ended): keep going
    const frames = channels[0].length;
    for (let i = 0; i < frames; i += 1) {
      let sum = 0;
      for (const channel of channels) sum += channel[i];
      this.chunk[this.filled] = sum / channels.length;
      this.filled += 1;
      if (this.filled === this.size) {
        this.port.postMessage(this.chunk, [this.chunk.buffer]); // moved, not copied
        this.chunk = new Float32Array(this.size);
        this.filled = 0;
      }
    }
    return true;
  }
}

registerProcessor("capture", Capture);
