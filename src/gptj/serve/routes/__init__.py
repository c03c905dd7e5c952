"""The app's routers, one per concern: v1 (OpenAI's completions and models), monitoring (/health,
/metrics), admin (publish and unpublish models); gptj.serve.app includes them."""
