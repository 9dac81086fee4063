"""myvllm"""
