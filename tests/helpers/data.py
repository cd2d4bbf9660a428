"""Small hand-made data shared by the test modules."""

from __future__ import annotations

# (query, a passage that answers it, another that does): the reranker tests' queries and positives; each
# topic's passages are the negatives of the others.
TOPICS = [
    (
        "what colour is the sky on a clear day",
        "The sky on a clear day is blue because air scatters blue light.",
        "Rayleigh scattering makes the daytime sky look blue.",
    ),
    (
        "who wrote the play hamlet",
        "Hamlet is a tragedy written by William Shakespeare.",
        "William Shakespeare wrote Hamlet around 1600.",
    ),
    (
        "what is the capital of france",
        "Paris is the capital and largest city of France.",
        "The French government sits in Paris, the capital.",
    ),
    (
        "how many legs does a spider have",
        "Spiders are arachnids with eight legs.",
        "Every spider walks on eight jointed legs.",
    ),
    (
        "what is the boiling point of water",
        "At sea level water boils at 100 degrees Celsius.",
        "Water turns to steam at 100 °C under standard pressure.",
    ),
    (
        "which planet is known as the red planet",
        "Mars is called the Red Planet because of iron oxide dust.",
        "The reddish colour of Mars comes from rusty soil.",
    ),
    (
        "who painted the mona lisa",
        "Leonardo da Vinci painted the Mona Lisa.",
        "The Mona Lisa is a portrait by Leonardo da Vinci in the Louvre.",
    ),
    (
        "what gas do plants absorb",
        "Plants absorb carbon dioxide for photosynthesis.",
        "During photosynthesis leaves take in carbon dioxide.",
    ),
]
