"""kiln.loop_post: calls posted from another thread run on the loop, all of them and in order; a call
that raises is reported to the loop and the calls after it still run; one post a loop."""

from __future__ import annotations

import asyncio
import threading

from kiln.loop_post import LoopPosts


def test_calls_from_another_thread_run_on_the_loop_in_order():
    async def main() -> tuple[list[int], set[int]]:
        loop = asyncio.get_running_loop()
        post = LoopPosts().for_loop(loop)
        seen: list[int] = []
        threads: set[int] = set()
        done = loop.create_future()

        def note(i: int) -> None:
            seen.append(i)
            threads.add(threading.get_ident())
            if i == 999:
                done.set_result(None)

        # Bursts with pauses between, as the engine posts a step's deltas and then waits for the device.
        def engine() -> None:
            for i in range(1000):
                post.call(note, i)
                if i % 100 == 99:
                    threading.Event().wait(0.002)

        worker = threading.Thread(target=engine)
        worker.start()
        await asyncio.wait_for(done, 10)
        worker.join()
        return seen, threads

    seen, threads = asyncio.run(main())
    assert seen == list(range(1000))
    assert len(threads) == 1


def test_a_call_that_raises_is_reported_and_the_rest_still_run():
    async def main() -> tuple[list[str], list[BaseException]]:
        loop = asyncio.get_running_loop()
        reported: list[BaseException] = []
        loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
        post = LoopPosts().for_loop(loop)
        seen: list[str] = []

        def fail() -> None:
            raise ValueError("boom")

        post.call(seen.append, "before")
        post.call(fail)
        post.call(seen.append, "after")
        await asyncio.sleep(0.05)
        return seen, reported

    seen, reported = asyncio.run(main())
    assert seen == ["before", "after"]
    assert len(reported) == 1 and isinstance(reported[0], ValueError)


def test_one_post_for_each_loop():
    posts = LoopPosts()
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert posts.for_loop(first) is posts.for_loop(first)
        assert posts.for_loop(first) is not posts.for_loop(second)
    finally:
        first.close()
        second.close()
