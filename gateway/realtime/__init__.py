"""Live transcription over a WebSocket: the OpenAI Realtime transcription protocol.

- `protocol`: the events (server events built, client events read) and the session config;
- `vad`: silero-vad on onnxruntime and the turn detector (server VAD);
- `buffer`: the input audio buffer: PCM16 in, 16 kHz float out, turns cut by the detector;
- `session`: one connection's state machine; each committed turn is an ordinary task in the
  backend's `interactive` lane, its segments streamed back as deltas;
- `connection`: the socket's edge: key, subprotocol, limits, the receive loop.

The route is gateway/routes/realtime.py.
"""
