"""Framework integrations beside the SDK, one room each: ``integrations.langchain``
(a runnable for LCEL chains, a retriever over the offline corpus) and ``integrations.llamaindex``
(a query engine, a response synthesizer and an LLM over minipic). Each imports its framework;
nothing here is imported by the SDK (``orchestrator``), so the SDK installs and starts without
either framework.
"""
