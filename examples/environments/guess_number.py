"""A text environment: guess the number, a multi-turn game with a verifiable reward.

reset() takes the secret number from the dataset row (guess_number.jsonl: a prompt and a `secret` from 1 to 10) and
adds the rules to the prompt; step() reads the reply's last number and answers "Higher." or "Lower." as the next user
turn, until the guess is right (reward 1, less 0.1 for each wrong guess before it) or the turns run out (reward 0).
Train SmolLM2-135M-Instruct on the CPU (about 4 minutes; the missing-EOS penalty, on an episode whose turn ran past
its 32 tokens, teaches it to answer with a number and stop, and so to reach its later guesses):

    python grpo.py --dataset_name examples/environments/guess_number.jsonl \
        --environment examples/environments/guess_number.py:GuessNumber --max_turns 4 --response_length 32 \
        --missing_eos_penalty 0.5
"""

import re


class GuessNumber:
    text_environment = True  # step(completion) -> (observation, reward, done); without it, methods are tools

    def reset(self, secret, **row):  # (a named parameter: the dataset must have that column, checked as it loads)
        self.secret, self.wrong = secret, 0
        return " I picked a whole number from 1 to 10. Guess it: reply with one number only, for example 4."

    def step(self, completion):
        numbers = re.findall(r"\d+", completion)
        if numbers and int(numbers[-1]) == self.secret:
            return None, max(0.0, 1.0 - 0.1 * self.wrong), True
        self.wrong += 1
        if not numbers:
            return "Answer with one number from 1 to 10.", 0.0, False
        return ("Higher." if int(numbers[-1]) < self.secret else "Lower."), 0.0, False
