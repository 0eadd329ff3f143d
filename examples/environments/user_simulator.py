"""A text environment: a simulated user who asks one follow-up, and a reward for the mood of every reply.

After the model's first reply the user asks a second question, drawn from a fixed set (Python's random, which the
scripts seed per prompt); each reply earns its VADER sentiment over the number of replies, so the episode's reward is
the mean sentiment of the two. Train SmolLM2-135M-Instruct on the CPU on the shipped prompts:

    python rloo.py --rloo_k 4 --environment examples/environments/user_simulator.py:UserSimulator \
        --max_turns 2 --response_length 48
"""

import random

from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

FOLLOW_UPS = [
    "Can you say more about that?",
    "Why do you think so?",
    "What would you tell a friend about it?",
    "How does that make you feel?",
    "Could you sum that up in a few words?",
]
ANALYZER = SentimentIntensityAnalyzer()


class UserSimulator:
    text_environment = True  # step(completion) -> (observation, reward, done); without it, methods are tools
    turns = 2

    def reset(self, **row):
        self.follow_up = random.choice(FOLLOW_UPS)
        self.replies = 0

    def step(self, completion):
        self.replies += 1
        reward = ANALYZER.polarity_scores(completion)["compound"] / self.turns
        if self.replies == self.turns:
            return None, reward, True
        return self.follow_up, reward, False
