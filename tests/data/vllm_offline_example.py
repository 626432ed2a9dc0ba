"""Offline inference with vLLM's ``LLM`` class: generate text, chat with a tool, embed
sentences and score them.

Written against vLLM's API, the way vLLM's offline examples are; tests/test_offline.py
runs it with only its ``from vllm import`` line changed to ``from engine import``::

    python vllm_offline_example.py --model MODEL --embed-model EMBEDDING_MODEL \
        [--chat-template FILE] [--dtype float32]
"""

import argparse

from vllm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox",
    "Paged attention stores keys",
]

SENTENCES = [
    "A cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply on Monday.",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name."}},
            "required": ["city"],
        },
    },
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a generative model")
    parser.add_argument("--embed-model", required=True, help="a sentence embedding model")
    parser.add_argument("--chat-template", help="a jinja chat template file (tool aware)")
    parser.add_argument("--dtype", default="auto")
    return parser.parse_args()


def generate(llm: LLM) -> None:
    # Greedy, so the same script gives the same text on every run.
    sampling_params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate(PROMPTS, sampling_params)
    print("Generated outputs:")
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {completion.text!r}")
        print(f"Token ids: {list(completion.token_ids)!r}")


def show_reply(output: object) -> None:
    print(f"Chat prompt: {output.prompt!r}")
    print(f"Chat reply: {output.outputs[0].text!r}")
    print(f"Token ids: {list(output.outputs[0].token_ids)!r}")


def chat_with_a_tool(llm: LLM, chat_template: str | None) -> None:
    sampling_params = SamplingParams(temperature=0.0, max_tokens=8)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather like in Paris?"},
    ]
    outputs = llm.chat(messages, sampling_params, tools=[WEATHER_TOOL],
                       chat_template=chat_template)
    show_reply(outputs[0])

    # The assistant called the tool; its answer goes back for the final reply.
    messages.append({
        "role": "assistant",
        "content": "",
        "tool_calls": [{
            "id": "call_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }],
    })
    messages.append({"role": "tool", "tool_call_id": "call_0",
                     "content": "18 degrees and sunny"})
    outputs = llm.chat(messages, sampling_params, tools=[WEATHER_TOOL],
                       chat_template=chat_template)
    show_reply(outputs[0])


def embed_and_score(model: str, dtype: str) -> None:
    llm = LLM(model=model, runner="pooling", dtype=dtype)
    outputs = llm.embed(SENTENCES)
    for sentence, output in zip(SENTENCES, outputs, strict=True):
        print(f"Sentence: {sentence!r}")
        print(f"Embedding: {output.outputs.embedding!r}")
    # How close the first sentence is to each of the others (cosine similarity).
    scores = llm.score(SENTENCES[0], SENTENCES[1:])
    for other, output in zip(SENTENCES[1:], scores, strict=True):
        print(f"Against: {other!r}")
        print(f"Score: {output.outputs.score!r}")


def main() -> None:
    args = parse_args()
    chat_template = None
    if args.chat_template:
        with open(args.chat_template) as f:
            chat_template = f.read()
    llm = LLM(model=args.model, dtype=args.dtype)
    generate(llm)
    chat_with_a_tool(llm, chat_template)
    embed_and_score(args.embed_model, args.dtype)


if __name__ == "__main__":
    main()
