"""The OpenAI-style calls' logic, behind thin routers (gateway/routes/openai.py, speech.py):
`calls` queues a task and waits for it, `transcription` and `speech` validate, wait and
answer; `models` lists what `model` may name."""
