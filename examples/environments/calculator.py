"""A tool environment in TRL's form (environment_factory): the shipped arithmetic task with a calculator.

The class's public methods are the tools, offered to the model through the chat template; a turn that calls one gets
its result back as a tool message, and the episode ends at the first turn that calls none (the answer), which the
`accuracy` reward scores. SmolLM2's own chat template has no tools, so the command gives it one that has
(chatml_tools.jinja, the same ChatML tokens); with the tool's schema a prompt is 214 tokens, hence
--max_prompt_length 256. Train SmolLM2-135M-Instruct on the CPU:

    python grpo.py --dataset_name data/arithmetic.jsonl --reward_fn accuracy \
        --environment examples/environments/calculator.py:Calculator \
        --chat_template examples/environments/chatml_tools.jinja --max_turns 3 --response_length 48 --max_prompt_length 256
"""

import ast
import operator

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class Calculator:
    def reset(self, **row):
        return None  # the prompt as it is

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression of numbers with +, -, *, / and parentheses.

        Args:
            expression: the expression, for example "12 * (3 + 4)"

        Returns:
            The value of the expression.
        """

        def value(node):
            if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
                return node.value
            if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
                return OPERATORS[type(node.op)](value(node.left), value(node.right))
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                return -value(node.operand)
            raise ValueError(f"not an arithmetic expression: {expression!r}")

        result = value(ast.parse(expression, mode="eval").body)
        return str(int(result) if float(result).is_integer() else result)
