"""The text of the demo workload: a shared system prompt, questions, a long document.

All of it is made up for this project (a fictional rail company), long enough that the
system prompt fills a few dozen KV pages and a document runs past a 512-token window.
"""

from __future__ import annotations

SYSTEM_PROMPT = """\
You are the customer support agent of Northwind Rail, a regional train operator with \
four lines: the Coast Line from Harbourside to Pellham Bay, the Valley Line from \
Harbourside to Aldermoor, the Lakes Line from Aldermoor to Finch Water, and the night \
sleeper from Harbourside to the capital. Answer in plain, friendly English, in at most \
three sentences, and never invent a timetable.

Facts you may use:
- Tickets: single, return, and the Rover pass (seven days of travel on every line except \
the sleeper). Children under five travel free; under sixteen pay half.
- Refunds: an unused ticket is refunded in full until the day before travel; on the day, \
a fee of three pounds applies. Delays over thirty minutes earn half of the fare back.
- Bicycles: free on the Coast and Lakes lines, booking required on the Valley Line, not \
allowed on the sleeper.
- Luggage: two large cases and one small bag per passenger. Pets on a lead travel free.
- Assistance: book at least four hours ahead for step-free help at any station.
- Wi-Fi and power sockets are on every train; the sleeper has a cafe car until midnight.

Previous conversation turns are not shown. If a question is outside these facts, say so \
and offer the phone line, open from seven in the morning to ten at night."""

QUESTIONS = (
    "Can I take my bike on the Valley Line tomorrow morning?",
    "My train was forty minutes late. What do I get back?",
    "How much does a ticket cost for my four-year-old daughter?",
    "Is there anywhere to charge my laptop on the train?",
    "I bought a return ticket but cannot travel today. Can I get a refund?",
    "Does the Rover pass cover the night sleeper?",
    "I use a wheelchair. How do I get help at Aldermoor station?",
    "Can my dog come with me to Finch Water?",
    "How many suitcases may I bring?",
    "Is the cafe on the sleeper open at one in the morning?",
    "What lines does Northwind Rail run?",
    "My son is fourteen. Does he pay full fare?",
)

DOCUMENT_PARAGRAPHS = (
    "We left Harbourside on the 07:12 Coast Line service with two adults, two children "
    "and three bicycles. The platform staff helped us load the bikes into the end "
    "carriage, which was already half full of surfboards, and the guard made an "
    "announcement asking passengers to keep the doorways clear.",
    "Between Saltmarsh and Pellham Bay the train stopped for twenty-five minutes because "
    "of a fallen tree. The guard walked through every carriage twice, explained what was "
    "happening and handed out water to the families. The children spent the wait "
    "counting the herons on the marsh.",
    "At Pellham Bay we found that the lift to the footbridge was out of order. A member "
    "of staff carried our youngest's pushchair up the stairs and showed us the ramp at "
    "the far end of the platform, which nobody had mentioned in the journey planner.",
    "The return journey on the Valley Line was busier. Our bicycle booking had been "
    "recorded for the wrong day, so the conductor could only take two of the three bikes. "
    "She wrote down our booking reference and promised that customer relations would call.",
    "At Aldermoor we changed to the Lakes Line. The connection was tight, six minutes, "
    "but the departure screens were clear and the train waited for passengers from the "
    "late Valley Line service. The Lakes Line carriages were new, quiet and spotless.",
    "Finch Water station has a small cafe and a bike shop. We rented a tandem for the "
    "afternoon and rode around the lake, then caught the 18:40 back. The Wi-Fi worked for "
    "the whole trip, which kept the children happy with their cartoons.",
    "On the final leg to Harbourside the train was delayed by thirty-five minutes because "
    "of a signal fault. We were told we could claim half of the fare back, but the form on "
    "the website asks for a ticket number that is not printed on mobile tickets.",
    "Overall the staff were kind and helpful every time something went wrong, the trains "
    "were clean, and the scenery on the Coast Line is the best in the region. We would "
    "travel again, but the bicycle bookings and the refund form need fixing.",
)
