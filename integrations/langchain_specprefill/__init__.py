"""LangChain chat model backed by a specprefill-engine Engine."""
