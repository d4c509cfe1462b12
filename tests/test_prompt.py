from qevolve.models.prompt import ChatFormat, PromptBuilder, parse_action


def test_parse_action_accepts_one_action_with_optional_thought():
    assert parse_action("Action: go to desk 1") == ("go to desk 1", "")
    assert parse_action("Thought: the book may be on the desk.\nAction: Go To Desk 1 ") == ("go to desk 1", "")


def test_parse_action_reports_format_errors():
    assert parse_action("go to desk 1") == (None, "no action")
    assert parse_action("Action:   ") == (None, "no action")
    assert parse_action("Action: look\nAction: inventory") == (None, "several actions")


def test_chat_format_read_from_template(tiny_tokenizer):
    fmt = ChatFormat.from_tokenizer(tiny_tokenizer)
    assert (fmt.head, fmt.user_start, fmt.user_end, fmt.assistant_end) == (
        "",
        "<|user|>\n",
        "<|end|>\n<|assistant|>\n",
        "<|end|>\n",
    )


def _episode(n):
    obs = ["You are in the middle of a room."] + [f"You arrive at cabinet {i}." for i in range(1, n + 1)]
    acts = [f"Action: go to cabinet {i}" for i in range(1, n + 1)]
    return "put some book on sidetable.", obs, acts


def test_prompt_matches_chat_template(tiny_tokenizer):
    b = PromptBuilder(tiny_tokenizer, context_tokens=10_000)
    instr, obs, acts = _episode(2)
    msgs = [{"role": "user", "content": b.first_user_text(instr, obs[0])}]
    for a, o in zip(acts, obs[1:]):
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": o}]
    expected = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tiny_tokenizer.decode(b.prompt(instr, obs, acts)) == expected


def test_loss_mask_covers_action_tokens_only(tiny_tokenizer):
    b = PromptBuilder(tiny_tokenizer, context_tokens=10_000)
    instr, obs, acts = _episode(3)
    [(ids, mask)] = b.training_examples(instr, obs, acts)
    masked = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert masked == "".join(a + "<|end|>\n" for a in acts)
    unmasked = tiny_tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "go to cabinet" not in unmasked and "cabinet 2." in unmasked


def test_truncation_keeps_first_turn_and_latest_turns(tiny_tokenizer):
    instr, obs, acts = _episode(30)
    full = PromptBuilder(tiny_tokenizer, context_tokens=100_000).prompt(instr, obs, acts)
    b = PromptBuilder(tiny_tokenizer, context_tokens=len(full) // 3)
    ids = b.prompt(instr, obs, acts)
    text = tiny_tokenizer.decode(ids)
    assert len(ids) <= b.context_tokens
    assert text.startswith("<|user|>\n" + b.first_user_text(instr, obs[0]))
    assert text.endswith("You arrive at cabinet 30.<|end|>\n<|assistant|>\n")
    assert "go to cabinet 2<" not in text  # an early middle turn was dropped


def test_long_trajectory_becomes_windows_covering_every_action_once(tiny_tokenizer):
    instr, obs, acts = _episode(30)
    b = PromptBuilder(tiny_tokenizer, context_tokens=400)
    examples = b.training_examples(instr, obs, acts)
    assert len(examples) > 1
    targets = "".join(tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in examples)
    assert targets == "".join(a + "<|end|>\n" for a in acts)
    assert all(len(ids) <= 400 for ids, _ in examples)


def test_windows_locate_each_step_and_its_next_state(tiny_tokenizer):
    b = PromptBuilder(tiny_tokenizer, context_tokens=90)
    instr, obs, acts = _episode(5)
    windows = b.windows(instr, obs, acts, lookahead=True)  # obs has one more entry: the final state
    assert len(windows) > 1
    trained = [s for w in windows for s, _, a, e in w.steps if e > a]
    assert trained == list(range(5))  # every action in exactly one window, in order
    for w in windows:
        have = {s for s, *_ in w.steps}
        for step, obs_end, a, e in w.steps:
            # V is read right before the action: the last token of the assistant prompt.
            assert tiny_tokenizer.decode(w.ids[: obs_end + 1]).endswith("<|assistant|>\n")
            if e > a:
                assert tiny_tokenizer.decode(w.ids[a:e]) == f"{acts[step]}<|end|>\n"
                assert step + 1 in have and all(w.mask[a:e]) and sum(w.mask) >= e - a


def test_repeat_task_follows_every_observation(tiny_tokenizer):
    instr, obs, acts = _episode(2)
    text = tiny_tokenizer.decode(PromptBuilder(tiny_tokenizer, 10_000, repeat_task=True).prompt(instr, obs, acts))
    assert text.count(f"Your task is to: {instr}") == 3


def test_a_runaway_observation_is_cut_to_its_budget_and_counted(tiny_tokenizer):
    builder = PromptBuilder(tiny_tokenizer, 512, max_observation_tokens=40)
    huge = "You arrive at desk 1. " * 50_000  # about 1 MB
    prompt = builder.prompt("put some book on sidetable.", ["You are in a room.", huge], ["Action: go to desk 1"])
    assert len(prompt) < 512 and len(builder.truncated) == 1
    assert tiny_tokenizer.decode(prompt).count("You arrive at desk 1.") < 20 and "[...]" in tiny_tokenizer.decode(
        prompt
    )
    builder.prompt("put some book on sidetable.", ["You are in a room.", huge], ["Action: go to desk 1"])
    assert len(builder.truncated) == 1  # counted once per observation, however often it is prompted
