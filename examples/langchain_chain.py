"""An LCEL chain with a prompt template, the chat model, and an output parser,
plus a tool bound the way an agent binds it. Offline, on the demo pair."""

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool

from langchain_specprefill import ChatSpecPrefill
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.loading import DEMO_TARGET


@tool
def lookup_registry(key: str) -> str:
    """Look a key up in the registry."""
    return "unknown"


def main() -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    case = make_case(load_tokenizer(DEMO_TARGET), seed=3, kind="passkey", n_tokens=2500)
    llm = ChatSpecPrefill(max_tokens=12, keep=0.3)
    prompt = ChatPromptTemplate.from_messages([("user", "{document}\n{question}")])
    chain = prompt | llm | StrOutputParser()
    answer = chain.invoke({"document": case.context, "question": case.question})
    print(f"chain answer: {answer.strip()!r} (expected {case.answer})")

    agent_llm = llm.bind_tools([lookup_registry])  # tool schemas go to the chat template
    message = agent_llm.invoke(case.question)
    print(f"tool calls: {message.tool_calls} (the demo model answers in text)")


if __name__ == "__main__":
    main()
