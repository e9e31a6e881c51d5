"""A one-tool OpenAI Agents SDK session, to capture what the SDK sends (see relay.py and
tests/fixtures/clients/README.md).

The agent has one function tool, `list_files` (and `read_file` with `--read-tool`), and is asked to list the files
in the current folder; with the relay's answer_ls.json script it calls the tool once and then answers. Needs `pip install openai-agents` (kept out
of the project's own environment):

    python benchmarks/agents/agents_sdk_task.py --base-url http://127.0.0.1:9000/v1 --api responses
    python benchmarks/agents/agents_sdk_task.py --base-url http://127.0.0.1:9000/v1 --api chat --stream
"""
import argparse
import asyncio
import os

from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def list_files() -> str:
    """List the files in the current working folder."""
    return "\n".join(sorted(os.listdir(".")))


@function_tool
def read_file(path: str) -> str:
    """Read a file in the current working folder."""
    try:
        return open(path, encoding="utf-8").read()
    except OSError as e:
        return f"Error: {e}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:9000/v1")
    p.add_argument("--model", default="demo-chat")
    p.add_argument("--api", choices=["responses", "chat"], default="responses",
                   help="OpenAIResponsesModel (the SDK's default) or OpenAIChatCompletionsModel")
    p.add_argument("--stream", action="store_true", help="Runner.run_streamed instead of Runner.run_sync")
    p.add_argument("--prompt", default="list the files here")
    p.add_argument("--read-tool", action="store_true", help="give the agent read_file as well")
    args = p.parse_args()

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "x"))
    model_class = OpenAIResponsesModel if args.api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="Assistant", instructions="You are a helpful assistant. Use tools when they help.",
                  model=model_class(model=args.model, openai_client=client),
                  tools=[list_files, read_file] if args.read_tool else [list_files])
    if args.stream:
        async def run():
            result = Runner.run_streamed(agent, args.prompt)
            async for _ in result.stream_events():
                pass
            return result
        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, args.prompt)
    print(result.final_output)


if __name__ == "__main__":
    main()
