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


# Chat-like prompts to train a draft head on (benchmarks/draft_head.py): templates × subjects, none of them in CHAT
# (the evaluation prompts), so a head is never measured on what it was trained on.
_ASKS = [
    "Explain {s} in simple terms.",
    "What are the most common mistakes people make with {s}?",
    "Give me three tips about {s}.",
    "Write a short paragraph about {s}.",
    "How would you describe {s} to a friend who has never heard of it?",
    "What is the history of {s}, in a few sentences?",
    "Why do people care about {s}?",
    "Write a short poem about {s}.",
    "What should a beginner know about {s}?",
    "List the pros and cons of {s}.",
    "Tell me a fun fact about {s}.",
    "How can I get better at {s}?",
    "Write a friendly email inviting a colleague to learn about {s}.",
    "Summarize what you know about {s} in five bullet points.",
    "What questions should I ask an expert on {s}?",
    "Describe a typical day for someone who works with {s}.",
]
_SUBJECTS = [
    "gardening",
    "the water cycle",
    "saving money",
    "learning a new language",
    "photosynthesis",
    "running a marathon",
    "baking bread",
    "volcanoes",
    "public speaking",
    "the moon",
    "recycling",
    "chess",
    "bees",
    "time management",
    "the internet",
    "rainbows",
    "camping",
    "healthy breakfasts",
    "ancient Egypt",
    "electric cars",
    "meditation",
    "the ocean",
    "painting with watercolors",
    "dinosaurs",
    "playing the guitar",
    "climate",
    "friendship",
    "job interviews",
    "the solar system",
    "coffee",
    "birds that migrate",
    "writing a resume",
    "yoga",
    "earthquakes",
    "museums",
    "cooking pasta",
    "libraries",
    "the human heart",
    "bicycles",
    "board games",
    "thunderstorms",
    "owning a dog",
    "mountains",
    "recipes with rice",
    "the printing press",
    "trains",
    "honey",
    "sleep",
]


def chat_like(n: int, seed: int = 0) -> list[str]:
    """n distinct chat-like prompts (a seeded sample of templates × subjects); never any of CHAT."""
    import random

    pairs = [(a, s) for a in _ASKS for s in _SUBJECTS]
    random.Random(seed).shuffle(pairs)
    if n > len(pairs):
        raise ValueError(f"only {len(pairs)} chat-like prompts exist; asked for {n}")
    out = [a.format(s=s) for a, s in pairs[:n]]
    assert not set(out) & set(CHAT)
    return out
