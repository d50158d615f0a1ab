"""Prompt sets the engine benchmarks share: copy-heavy (the answer reuses the input) and free-form."""

# Tasks whose answers reuse the input. The 135M model answers some rewrite instructions (extract names, build a
# table) with something else entirely; these are ones it answers by reusing its input.
COPY_HEAVY = [
    "Fix the spelling mistakes in this paragraph and return the corrected paragraph: The new release improvs the "
    "upload client, which now retries failed requests with exponential backoff. The config parser no longer crashes "
    "when the file is emtpy, and the metrics exporter uses a default timeout of thirty seconds.",
    "Add a docstring to this Python function and return the whole function:\n\ndef retry_upload(client, blob, "
    "attempts=3):\n    for i in range(attempts):\n        try:\n            return client.put(blob)\n        except "
    "TimeoutError:\n            time.sleep(2 ** i)\n    raise RuntimeError('upload failed')",
    "Rewrite these engineering notes as a bulleted list, keeping every item word for word: fixed crash in the "
    "config parser when the file is empty; added exponential backoff to the upload client; removed the deprecated "
    "v1 sync endpoint; raised the default timeout of the metrics exporter from 5 to 30 seconds.",
    'Convert this JSON to YAML:\n{"name": "uploader", "version": "2.4.1", "retries": 3, "backoff": "exponential", '
    '"endpoints": ["/v2/sync", "/v2/upload", "/v2/status"], "timeout_seconds": 30}',
    "Put each sentence of this text on its own line: The parser no longer crashes on empty files. Uploads now retry "
    "with exponential backoff. The v1 sync endpoint has been removed. The exporter timeout is now thirty seconds.",
]
FREE_FORM = [
    "Why is the sky blue? Explain it to a curious ten-year-old.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for a new software engineer?",
    "Describe a walk through a forest in autumn.",
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# General conversation, where n-gram drafts rarely match: what adaptive k must not make slower.
CHAT = [
    *FREE_FORM,
    "How do I politely decline a meeting invitation from my manager?",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Can you suggest a name for a small bakery that sells sourdough bread?",
    "Explain the difference between a virus and a bacterium in simple terms.",
    "I have eggs, spinach and cheese. What can I cook for dinner?",
    "Write a haiku about the first snow of winter.",
    "What are some tips for sleeping better at night?",
    "Why do cats purr?",
]
