"""Generate the benchmark prompt sets in this directory (deterministic; rerun to regenerate).

    python sparkfleet/hostlib/data/workloads/make_workloads.py          # writes the *.json next to it
    python sparkfleet/hostlib/data/workloads/make_workloads.py --check  # exit 1 if a file is out of date

Every text here is written for sparkfleet or composed from the templates below with a fixed
seed; nothing is downloaded. See README.md in this directory for what each set stands for.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20260624

PROSE_TOPICS = [
    "why lighthouses were painted with distinct stripes and patterns",
    "how a small town library changes over a century",
    "the experience of learning to sail on a windy lake",
    "what makes a good neighbourhood bakery worth the walk",
    "the history of the bicycle and how it changed daily life",
    "a rainy afternoon in a train station, seen by a ticket clerk",
    "why people keep paper notebooks in a digital age",
    "how bees decide where to build a new hive",
    "the quiet work of restoring an old wooden boat",
    "what a mountain hut keeper sees over one winter",
]

CODE_TASKS = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals "
    "and returns them sorted. Include a docstring and three doctest examples.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` in O(1) using an ordered "
    "dict, with a capacity given to the constructor. Add type hints.",
    "Write a C function `size_t count_words(const char *s)` that counts whitespace-separated words, "
    "and a small `main` that tests it on three strings.",
    "Write a Python function that parses lines like `key = value # comment` into a dict, ignoring "
    "blank lines and comments, and raising ValueError with the line number on bad input.",
    "Write a Bash script that finds the ten largest files under a directory given as its first "
    "argument and prints their sizes in a human-readable form.",
    "Write a Python generator `sliding_window(iterable, n)` that yields tuples of n consecutive "
    "items, and unit tests for it using pytest.",
    "Write a Rust function `fn is_palindrome(s: &str) -> bool` that ignores case and non-alphanumeric "
    "characters, with tests in a `#[cfg(test)]` module.",
    "Write a SQL schema for a small lending library (books, members, loans) and a query that lists "
    "members with overdue loans, oldest first.",
]

COUNTING_TASKS = [
    "Count from 1 to 300, one number per line, with no other text.",
    "Write the numbers from 100 down to 1, separated by commas, with no other text.",
    "List the even numbers from 2 to 400, one per line, with no other text.",
    "Write the multiplication table of 7 from 7 x 1 to 7 x 60, one line each, like `7 x 1 = 7`.",
    "Repeat the line `the quick brown fox jumps over the lazy dog` forty times, numbered 1 to 40.",
    "Write the English alphabet in capital letters, one letter per line, then again in lower case.",
]

# Tool definitions for the synthetic agent set, rendered into the system prompt the way a Qwen
# chat template renders tools (a <tools> block, calls as <tool_call>{json}</tool_call>).
AGENT_TOOLS = [
    {"name": "read_file", "description": "Read a text file", "parameters": {"path": "string"}},
    {"name": "list_dir", "description": "List a directory", "parameters": {"path": "string"}},
    {"name": "run_shell", "description": "Run a shell command", "parameters": {"command": "string"}},
    {
        "name": "write_file",
        "description": "Write a text file",
        "parameters": {"path": "string", "content": "string"},
    },
    {"name": "search_code", "description": "Search the code base", "parameters": {"pattern": "string"}},
]

AGENT_GOALS = [
    ("the unit tests in tests/ fail after the last change to config.py", "config.py"),
    ("the service log shows a timeout talking to the database", "db.py"),
    ("add a --verbose flag to the command line tool in cli.py", "cli.py"),
    ("the nightly report job writes an empty CSV file", "report.py"),
    ("rename the function load_settings to read_settings everywhere", "settings.py"),
    ("the README install steps mention a script that no longer exists", "README.md"),
    ("find why the cache hit rate dropped after the upgrade", "cache.py"),
    ("make the retry delay in client.py configurable", "client.py"),
]

SHAREGPT_SUBJECTS = [
    "a vegetable garden",
    "a first marathon",
    "a home network",
    "a small business budget",
    "learning the guitar",
    "a job interview",
    "a weekend hiking trip",
    "a book club",
    "a kitchen renovation",
    "a team retrospective",
    "a science fair project",
    "moving to a new city",
    "a bird feeder",
    "a family photo archive",
    "a board game night",
    "a winter bike commute",
]
SHAREGPT_ASKS = [
    "How should I plan {s}? Give me a short checklist.",
    "What are common mistakes people make with {s}?",
    "Can you explain, step by step, how to get started with {s}?",
    "I have one month to prepare {s}. What should I do each week?",
    "Write a friendly short message inviting two friends to help with {s}.",
    "Summarise the pros and cons of doing {s} on a tight budget.",
]
SHAREGPT_ANSWER_SENTENCES = [
    "Start by writing down what you want to achieve and by when.",
    "Keep the first version small so that you can finish it and learn from it.",
    "Set aside a fixed time each week and protect it like any other appointment.",
    "Make a short list of what you already have and what you still need.",
    "Ask someone who has done it before; one conversation can save a lot of time.",
    "Expect the first attempt to take longer than planned and leave some slack.",
    "Track what you spend, even roughly, so there are no surprises at the end.",
    "Write down what went well and what did not, and adjust the plan after each step.",
    "Break the work into pieces that take less than an hour each.",
    "Celebrate small milestones; they keep the motivation going.",
    "Check the weather, the tools and the materials the day before.",
    "Share the plan with the people involved so that everyone knows their part.",
]


def chat(user: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return messages


def chat_set(name: str, description: str, prompts: list[str]) -> dict[str, object]:
    """A workload of one-turn chats, one request per prompt (ids NAME-01, NAME-02, ...)."""
    requests = [
        {"id": f"{name}-{index:02d}", "messages": chat(prompt), "max_tokens": 512}
        for index, prompt in enumerate(prompts, 1)
    ]
    return {"name": name, "description": description, "requests": requests}


def prose_set() -> dict[str, object]:
    return chat_set(
        "prose",
        "Open-ended essays: low draft acceptance (the reference's 'Prose' row).",
        [f"Write a short essay of about 300 words about {topic}." for topic in PROSE_TOPICS],
    )


def code_set() -> dict[str, object]:
    return chat_set("code", "Small programming tasks: medium acceptance (the reference's 'Code' row).", CODE_TASKS)


def counting_set() -> dict[str, object]:
    return chat_set(
        "counting",
        "Highly predictable sequences: acceptance near the draft length (the 'Counting' row).",
        COUNTING_TASKS,
    )


def agent_system_prompt() -> str:
    tool_lines = "\n".join(json.dumps(tool, sort_keys=True) for tool in AGENT_TOOLS)
    return (
        "You are a coding agent working in a git repository. You may call tools.\n"
        f"<tools>\n{tool_lines}\n</tools>\n"
        'To call a tool, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call> and '
        "nothing else. Tool results come back inside <tool_response></tool_response>."
    )


def tool_call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, sort_keys=True) + "</tool_call>"


def agent_set(rng: random.Random) -> dict[str, object]:
    system = agent_system_prompt()
    requests = []
    for index, (goal, file_name) in enumerate(AGENT_GOALS, 1):
        listing = sorted({file_name, "tests/", "pyproject.toml", rng.choice(["utils.py", "main.py", "io.py"])})
        file_lines = [
            f"{n:3d}  " + rng.choice(["import os", "import json", "def main():", "    pass"]) for n in range(1, 7)
        ]
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Task: {goal}."},
            {"role": "assistant", "content": tool_call("list_dir", path=".")},
            {"role": "user", "content": "<tool_response>\n" + "\n".join(listing) + "\n</tool_response>"},
            {"role": "assistant", "content": tool_call("read_file", path=file_name)},
            {"role": "user", "content": "<tool_response>\n" + "\n".join(file_lines) + "\n</tool_response>"},
        ]
        requests.append({"id": f"agent-{index:02d}", "messages": messages, "max_tokens": 256})
    return {
        "name": "agent",
        "description": (
            "SYNTHETIC agent tool-call turns (system prompt with tool definitions, prior tool calls "
            "and results inline, next turn is a tool call). Stands in for the reference's private "
            "Hermes agent logs; its acceptance will differ from real agent traffic."
        ),
        "requests": requests,
    }


def albond_e2e_set() -> dict[str, object]:
    # albond's method fixes five prompts with these max_tokens; his prompt texts are not
    # reproduced here, these are sparkfleet's own prompts of a similar mix.
    prompts = [
        ("e2e-1", "Explain how a hash table handles collisions, with a short example.", 256),
        (
            "e2e-2",
            "Write a Python function that returns the n-th Fibonacci number iteratively, "
            "then explain its time and memory cost.",
            512,
        ),
        (
            "e2e-3",
            "Write a detailed tutorial on setting up a small home web server, covering "
            "hardware, operating system, firewall and backups.",
            1024,
        ),
        ("e2e-4", "What is the capital of France? Answer in one sentence.", 64),
        ("e2e-5", "Write a long story about a robot who learns to paint, in several chapters.", 2048),
    ]
    return {
        "name": "albond_e2e",
        "description": (
            "albond's end-to-end method: five prompts with max_tokens 256/512/1024/64/2048, "
            "non-streaming, temperature 0, each run twice and run 1 discarded. Prompt texts are "
            "sparkfleet's own."
        ),
        "requests": [
            {"id": rid, "messages": chat(text), "max_tokens": max_tokens} for rid, text, max_tokens in prompts
        ],
    }


def sharegpt_small(rng: random.Random, count: int = 96) -> list[dict[str, object]]:
    """A small synthetic ShareGPT-format dataset (what `vllm bench serve --dataset-name sharegpt` reads)."""
    conversations = []
    for index in range(count):
        subject = SHAREGPT_SUBJECTS[index % len(SHAREGPT_SUBJECTS)]
        ask = SHAREGPT_ASKS[(index // len(SHAREGPT_SUBJECTS) + index) % len(SHAREGPT_ASKS)]
        sentences = rng.sample(SHAREGPT_ANSWER_SENTENCES, rng.randint(3, 8))
        answer = f"Here is how I would approach {subject}. " + " ".join(sentences)
        conversations.append(
            {
                "id": f"sparkfleet-sharegpt-{index:03d}",
                "conversations": [
                    {"from": "human", "value": ask.format(s=subject)},
                    {"from": "gpt", "value": answer},
                ],
            }
        )
    return conversations


def agent_turns_set(rng: random.Random, count: int = 3, turns: int = 4) -> dict[str, object]:
    """Conversations for `bench prefix`: the agent system prompt, then turns that each add a tool result
    to the conversation so far (the model's own answers stay in it), as an agent's next turn does."""
    conversations = []
    for index, (goal, file_name) in enumerate(AGENT_GOALS[:count], 1):
        user_turns = [f"Task: {goal}. Start by looking around the repository."]
        for turn in range(1, turns):
            lines = [f"{n:3d}  " + rng.choice(["import os", "import json", "def main():", "    pass", "    return 0"])
                     for n in range(1, 5 + turn)]  # fmt: skip
            user_turns.append(
                f"<tool_response>\n{file_name} (part {turn}):\n" + "\n".join(lines) + "\n</tool_response>\n"
                "Continue with the task."
            )
        conversations.append(
            {"id": f"agent-turns-{index:02d}", "system": agent_system_prompt(), "turns": user_turns, "max_tokens": 256}
        )
    return {
        "name": "agent_turns",
        "description": (
            "SYNTHETIC multi-turn agent conversations for `bench prefix`: one system prompt shared by all, "
            "each turn the whole conversation so far plus a tool result; sent cold (a cache salt of its own) "
            "and warm (the run's salt) to measure what prefix caching saves."
        ),
        "conversations": conversations,
    }


def agent_turns_small_set(rng: random.Random) -> dict[str, object]:
    """`agent_turns` cut to fit a 1,024-token context with a small model's tokenizer (the sandbox): a
    short system prompt with two tools, four short turns."""
    tools = "\n".join(json.dumps(tool, sort_keys=True) for tool in AGENT_TOOLS[:2])
    system = f"You are a coding agent. Tools:\n{tools}\nCall one with <tool_call>{{...}}</tool_call>."
    conversations = []
    for index, (goal, file_name) in enumerate(AGENT_GOALS[:3], 1):
        turns = [f"Task: {goal}."]
        for turn in range(1, 4):
            line = rng.choice(["import os", "def main():", "    return 0"])
            turns.append(f"<tool_response>{file_name} {turn}: {line}</tool_response> Go on.")
        conversations.append(
            {"id": f"agent-turns-small-{index:02d}", "system": system, "turns": turns, "max_tokens": 256}
        )
    return {
        "name": "agent_turns_small",
        "description": "agent_turns sized for a 1,024-token context (the sandbox's tiny models): SYNTHETIC.",
        "conversations": conversations,
    }


def build_all() -> dict[str, object]:
    rng = random.Random(SEED)
    return {
        "prose.json": prose_set(),
        "code.json": code_set(),
        "counting.json": counting_set(),
        "agent.json": agent_set(rng),
        "albond_e2e.json": albond_e2e_set(),
        "sharegpt_small.json": sharegpt_small(rng),
        "agent_turns.json": agent_turns_set(rng),
        "agent_turns_small.json": agent_turns_small_set(rng),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the files are up to date")
    args = parser.parse_args(argv)
    stale = []
    for file_name, content in build_all().items():
        text = json.dumps(content, indent=1, ensure_ascii=False) + "\n"
        path = HERE / file_name
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(file_name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python {Path(__file__).name} to regenerate")
        return 1
    print("workload files " + ("up to date" if args.check else f"written to {HERE.name}/"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
