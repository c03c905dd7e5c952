"""MLPerf Inference gptj-99 harness: CNN-DailyMail summarization with GPT-J 6B."""
